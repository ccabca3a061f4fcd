"""Run a study — one process (``dsopt study run``) or one of many workers (``dsopt worker``): the process side.

The loop itself — lease → reference → propose → prune → launch → record → stop — is
:mod:`optimizer.search.study_loop`, beside the decisions it sequences. This module gives it what only a process
can: the storage opened (SQLite refused for workers), the study's traces, DeepSpeed's ops built once per node
before any launch (:mod:`launchers.study.op_prep`), this machine's kernels timed at the study's shapes before the
seeds are chosen (:mod:`launchers.probe.machine`, cached per machine), the FP32 reference and every trial as real
launches on this node (:func:`launchers.trial.run.run_trial`, with the ranks' stop-above limits and the predicted
step time for the hang timeout), the measured device reserve and capacity recorded after each launch, the warnings
a launch makes true (the device is not the study's profile, the script trains another model), the progress lines
(:mod:`launchers.study.progress`) and each trial's files in the artifact store.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import optuna

from launchers.study.artifacts import default_store_dir, uploader
from launchers.study.op_prep import prepare_ops, study_candidates
from launchers.study.progress import Progress, ProgressMode
from launchers.trial.reference_batches import judge_for, kept_as_reference, losses_for
from launchers.trial.reference_trial import reference_as_trial
from launchers.trial.run import (
    cached_reference_losses,
    reference_candidate,
    reference_key,
    reference_losses,
    run_trial,
    trial_dir_for,
)
from optimizer.ledger.core import Ledger, evaluate
from optimizer.ledger.items import Location
from optimizer.ledger.transformer import parameter_count, trainable_count
from optimizer.perf.probe_plan import probe_plan
from optimizer.results.device_budget import capacity_note
from optimizer.results.trial_result import StopAbove, TrialResult
from optimizer.search.coordination import CREATED_ATTR, worker_id
from optimizer.search.device_attrs import (
    measured_capacity,
    record_device,
    record_result_json,
    study_planning_spec,
)
from optimizer.search.objective import LaunchGate, open_study
from optimizer.search.ordering import predicted_speed, study_models
from optimizer.search.space import branches
from optimizer.search.storage import StorageKind, check_shared_storage, storage_kind
from optimizer.search.study_loop import LoopState, run_loop, setup_study
from optimizer.study.hardware_profiles import profile_mismatch
from optimizer.study.knobs import Candidate
from optimizer.study.specs import TransformerModel, baseline_candidate
from optimizer.study.study_file import StudySpec


def default_storage(spec: StudySpec) -> str:
    """``sqlite:///<abs>/studies/<name>/study.db`` — single process only (use PostgreSQL or a journal for workers)."""
    return f"sqlite:///{(spec.output_dir / 'study.db').resolve()}"


def _say(worker: str, text: str) -> None:
    print(f"[{worker}] {text}", file=sys.stderr, flush=True)


def _fail_stale(study: optuna.Study) -> None:
    """Optuna's ``fail_stale_trials`` (experimental since 2.9; stable in practice): fail the trials of dead
    workers and run the retry callback."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def run_study(*, spec: StudySpec, storage: str, n_trials: int | None, timeout_s: float | None,
              runner: Callable[[Candidate, list[float]], TrialResult] | None = None,
              parallel: bool = False, reference: Callable[[], list[float]] | None = None,
              sampler: optuna.samplers.BaseSampler | None = None,
              gpus: Sequence[str] | None = None, progress: ProgressMode = ProgressMode.HUMAN,
              replayed_reference: Callable[[Candidate], TrialResult | None] | None = None) -> optuna.Study:
    """Create or join the study on ``storage`` and run trials until a limit is reached (module doc).

    ``parallel`` (``dsopt worker``): other workers may share the storage, so SQLite is refused.
    ``runner`` and ``reference`` replace the real launches (the search-efficiency benchmark replays recorded
    measurements through them; ``replayed_reference`` gives what the replayed reference run measured of its
    candidate, recorded as the real reference's files are); ``sampler`` replaces Optuna's default (TPE) sampler.
    ``gpus`` is this worker's slice of its node's GPUs (:func:`launchers.trial.run.check_devices`), used by every
    launch including the reference; None: every GPU the process sees. ``progress``: what it prints
    (:mod:`launchers.study.progress`).
    """
    from launchers.probe.machine import PROBE_TIMEOUT_S, announcement, collect_riding, riding_input, with_probe
    from launchers.trace.study_traces import with_traced_activations

    space = branches(spec)  # validate before anything is written
    if parallel:
        check_shared_storage(storage)
    if storage == default_storage(spec):
        spec.output_dir.mkdir(parents=True, exist_ok=True)  # the SQLite file's folder
    worker = worker_id()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are data: our progress line reports them
    study = open_study(spec=spec, storage=storage, sampler=sampler)
    spec = with_traced_activations(spec)  # once the storage is known to be reachable; cached by content
    valid = study_candidates(spec)  # judged once: the ops' needs and the ledgers below are of these
    if runner is None:  # DeepSpeed's ops, once per node before any launch; drops what this node cannot build
        spec = prepare_ops(spec=spec, gpus=gpus, worker=worker, candidates=valid)
    # the machine's kernels at the study's shapes, before the seeds are chosen (cached per machine): at the end of
    # the FP32 reference's launch where it runs now, else on a launch of their own
    riding = riding_input(spec, gpus=gpus) if runner is None and cached_reference_losses(spec) is None else None
    if runner is None and riding is None:
        spec = with_probe(spec, gpus=gpus, holder=worker, say=lambda text: _say(worker, text))
    base = baseline_candidate(spec.training)
    baseline = reference_candidate(spec)  # the FP32 reference's candidate: its run is a whole trial of it
    ours = baseline in valid and baseline in set(spec.search_space.candidates(base))

    def reference_run() -> list[float]:
        launched = riding is not None and cached_reference_losses(spec) is None  # else its folder is not ours
        if launched:
            _say(worker, announcement(probe_plan(spec), within=" at the end of the FP32 reference's launch"))
        losses = reference_losses(spec, gpus=gpus, probe=riding if launched else None,
                                  probe_timeout_s=PROBE_TIMEOUT_S)
        if launched:
            collect_riding(spec, spec.output_dir / "reference", gpus=gpus, say=lambda text: _say(worker, text))
        return losses

    def reference_trial(study_spec: StudySpec, candidate: Candidate, *, trial_dir: Path | None) -> TrialResult | None:
        # the FP32 reference run as the trial of its candidate (no launch): its files, or a replay's measurement
        if candidate != baseline:
            return None
        if replayed_reference is not None:
            return replayed_reference(candidate)
        return None if runner is not None else reference_as_trial(study_spec, candidate, trial_dir=trial_dir)

    probed_specs: list[StudySpec] = []

    def probed() -> StudySpec:  # the riding probe, cached by now (or, where it failed, one of its own now), once
        if not probed_specs:
            probed_specs.append(with_probe(spec, gpus=gpus, holder=worker, say=lambda text: _say(worker, text)))
        return probed_specs[0]
    losses = setup_study(study=study, spec=spec, space=space, worker=worker, key=reference_key(spec),
                         say=lambda text: _say(worker, text),
                         measured=lambda: [(baseline, result)] if ours and (
                             result := reference_trial(spec, baseline, trial_dir=None)) is not None else [],
                         reference=reference or reference_run, seeding=probed if riding is not None else None,
                         reference_launches=(lambda: 0) if reference is not None
                         else (lambda: 0 if cached_reference_losses(spec) is not None else 1))
    if riding is not None:
        spec = probed()
    reference_result = spec.output_dir / "reference" / "result.json"  # the FP32 reference: the first launch
    if runner is None and reference_result.is_file():
        record_result_json(study, json.loads(reference_result.read_text()))
    stated = spec
    spec = study_planning_spec(stated, study)  # the measured device reserve and capacity (results/device_budget.py)
    capacity_said: list[str] = []
    say_capacity(stated, measured_capacity(study), said=capacity_said, worker=worker)

    mismatch_said: list[str] = []  # a device unlike hardware.profile: said once
    script_said: list[str] = []  # a script's model unlike the model section: said once

    def launch(candidate: Candidate) -> TrialResult:
        report.started(candidate)
        if runner is not None:
            return runner(candidate, losses)
        step = predicted_speed(candidate, spec=spec, models=state.models)  # calibrated once trials are measured
        judge = judge_for(stated, candidate)  # the study's FP32 reference, or its micro-batch's where dropout draws
        judged_by = None if judge.own else losses_for(judge, losses, gpus=gpus, say=lambda t: _say(worker, t))
        result = run_trial(study=spec, candidate=candidate, reference_losses=judged_by,
                           step_s=None if isinstance(step, str) else step.total_s, gpus=gpus,
                           stop_above=stop_above(spec, candidate, ledger=ledgers.get(candidate.label())))
        result = kept_as_reference(judge, candidate, result)  # where its run is that reference
        if judge.launches:  # counted with the trial's own launch (--n-trials, budget.max_launches)
            result = dataclasses.replace(result, reference_launches=judge.launches)
        say_profile_mismatch(spec, result, said=mismatch_said, worker=worker)
        say_script_model(spec, result, said=script_said, worker=worker)
        _, capacity = record_device(study, result)
        say_capacity(stated, capacity, said=capacity_said, worker=worker)
        return result

    fail_stale = _fail_stale if storage_kind(storage) is StorageKind.POSTGRESQL else None
    gate = LaunchGate(budget=spec.budget, worker=worker, created_at=study.user_attrs.get(CREATED_ATTR),
                      fail_stale=fail_stale)
    kept = set(spec.search_space.candidates(base))  # less what an op missing on this node rules out
    verdicts = [v for v in (evaluate(candidate=c, model=spec.model, hardware=spec.hardware, training=spec.training)
                            for c in valid if c in kept) if v.ledger is not None]
    ledgers = {v.candidate.label(): v.ledger for v in verdicts}  # evaluated once: launch() reads them
    state = LoopState(models=study_models(spec=spec, trials=[], base=base))
    report = Progress(progress, base=base, target=n_trials, worker=worker)
    try:
        run_loop(study, spec=spec, space=space, gate=gate, verdicts=verdicts, state=state, report=report,
                 runner=launch, n_trials=n_trials, timeout_s=timeout_s,
                 artifact_dir=lambda candidate: str(trial_dir_for(spec, candidate)),
                 after_launch=uploader(default_store_dir(spec.output_dir), warn=report.say),
                 measured=lambda candidate: reference_trial(stated, candidate,
                                                            trial_dir=trial_dir_for(spec, candidate)))
    finally:
        report.close()
    return study


def say_profile_mismatch(spec: StudySpec, result: TrialResult, *, said: list[str], worker: str) -> None:
    """Once per worker (``said`` keeps it): the device a trial reports is not the study's ``hardware.profile``
    (:func:`optimizer.study.hardware_profiles.profile_mismatch`), so its speed figures describe another GPU."""
    if said or spec.hardware.profile is None or result.device_name is None:
        return
    why = profile_mismatch(spec.hardware.profile, result.device_name, result.device_total_bytes)
    if why is not None:
        said.append(why)
        _say(worker, f"warning: {why}")


def say_script_model(spec: StudySpec, result: TrialResult, *, said: list[str], worker: str) -> None:
    """Once per worker: the model the user's script trains (``trial.command``) is not the model section's, so the
    ledger plans and prunes another model (both counts are in the trial's ``result.json`` and ``plan.json``)."""
    if result.script_parameters is None or not isinstance(spec.model, TransformerModel):
        return
    planned = parameter_count(spec.model)
    trains, planned_trains = result.script_trainable_parameters, trainable_count(spec.model)
    if result.script_parameters != planned:
        why = (f"the script trains {result.script_parameters:,} parameters, the study's model section plans "
               f"{planned:,}: the ledger's figures and its pruning describe another model — make the model section "
               "the script's (hf_config, shape keys or an entry point)")
    elif trains is not None and trains != planned_trains:
        why = (f"{trains:,} of the script's {planned:,} parameters train, the study plans {planned_trains:,}: the "
               "ledger's gradients and optimizer states describe another setup — say what trains with model.peft "
               "or training.frozen (docs/study-file.md, \"What trains\")")
    else:
        return
    if why not in said:
        said.append(why)
        _say(worker, f"warning: {why}")


def say_capacity(stated: StudySpec, capacity: int | None, *, said: list[str], worker: str) -> None:
    """Once per worker: the study's gpu_memory is more than the device has (``capacity``, measured; it plans with
    the device's)."""
    note = None if said else capacity_note(stated.hardware, measured_total_bytes=capacity)
    if note is not None:
        said.append(note)
        _say(worker, f"warning: {note}")


def stop_above(spec: StudySpec, candidate: Candidate, *, ledger: Ledger | None = None) -> StopAbove | None:
    """What the ranks may measure before they stop over the budget: the budget less the device reserve, plus
    on CPU ranks the ledger's host items (one memory holds both there; the objective subtracts them again,
    :func:`optimizer.search.objective.over_budget`). ``ledger``: the candidate's, where the caller has it."""
    if ledger is None:
        ledger = evaluate(candidate=candidate, model=spec.model, hardware=spec.hardware,
                          training=spec.training).ledger
    if ledger is None:
        return None
    budget = ledger.gpu_capacity_bytes - spec.hardware.device_reserve_bytes
    init_host = (ledger.init_bytes - ledger.init_bytes_at(Location.GPU)) if ledger.device_is_host else 0
    return StopAbove(training_bytes=budget + ledger.training_host_share_bytes, init_bytes=budget + init_host)
