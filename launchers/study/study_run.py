"""Run a study — one process (``dsopt study run``) or one of many workers (``dsopt worker``).

The glue between :mod:`optimizer.search.objective` (pure Optuna logic), :mod:`optimizer.search.coordination`
(shared-storage
rules) and :mod:`launchers.trial.run` (the launches). A worker:

1. opens the storage and creates or joins the study;
2. sets it up once per study file (setup lease): enqueues the ledger's most promising candidates and runs
   the FP32 reference; the other workers wait for it;
3. runs one trial at a time until its own ``--n-trials`` (real launches, retries and the reference included:
   a pruned, held or reused proposal launches nothing and spends nothing) or ``--timeout``, the study's global
   budget, or the search space is exhausted (every candidate that may fit has a final result). When the only
   candidates left are being launched by other workers it waits instead of sampling. With a heartbeat storage
   it fails the trials of dead workers first (Optuna's ``fail_stale_trials``), which puts them back in the queue.
   A stop by a limit lists the candidates left untried, with their predicted speed and probability to fit.

Progress is one line per finished trial on stderr (:mod:`launchers.study.progress`).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import optuna

from launchers.study.artifacts import default_store_dir, uploader
from launchers.study.op_prep import prepare_ops
from launchers.study.progress import Progress, ProgressMode
from launchers.trial.run import cached_reference_losses, reference_key, reference_losses, run_trial, trial_dir_for
from optimizer.ledger.core import Ledger, evaluate
from optimizer.ledger.items import Location
from optimizer.ledger.transformer import parameter_count, trainable_count
from optimizer.results.device_budget import capacity_note
from optimizer.results.trial_result import StopAbove, TrialResult
from optimizer.search.coordination import (
    CREATED_ATTR,
    LAUNCHES_ATTR,
    LEASE_REFRESH_S,
    REFERENCE_LAUNCHES_ATTR,
    WORKER_ATTR,
    SetupLease,
    active_claims,
    budget_spent,
    now_utc,
    worker_id,
)
from optimizer.search.device_attrs import (
    measured_capacity,
    record_measured_capacity,
    record_measured_reserve,
    record_result_json,
    study_planning_spec,
)
from optimizer.search.next_launch import Option, final_keys, options
from optimizer.search.objective import POLICY_MARK, LaunchGate, TrialFailed, make_objective, open_study, seed_study
from optimizer.search.ordering import (
    CALIBRATION_ATTR,
    EXPLORE_EVERY,
    StudyModels,
    predicted_speed,
    study_models,
)
from optimizer.search.space import Branches, branches, distribution_params, in_space
from optimizer.search.storage import StorageKind, check_shared_storage, storage_kind
from optimizer.search.untried import untried_text
from optimizer.study.hardware_profiles import profile_mismatch
from optimizer.study.knobs import Candidate
from optimizer.study.specs import TransformerModel, baseline_candidate
from optimizer.study.study_file import StudySpec

TrialState = optuna.trial.TrialState
WAIT_S = 2.0
"""Poll interval while waiting for another worker (setup, or the last candidates in flight)."""


def default_storage(spec: StudySpec) -> str:
    """``sqlite:///<abs>/studies/<name>/study.db`` — single process only (use PostgreSQL or a journal for workers)."""
    return f"sqlite:///{(spec.output_dir / 'study.db').resolve()}"


def _say(worker: str, text: str) -> None:
    print(f"[{worker}] {text}", file=sys.stderr, flush=True)


def setup_study(*, study: optuna.Study, spec: StudySpec, space: Branches, worker: str,
                reference: Callable[[], list[float]], wait_s: float = WAIT_S,
                reference_launches: Callable[[], int] = lambda: 0) -> list[float]:
    """Seed the study and obtain the FP32 reference losses exactly once per study file (setup lease);
    returns the reference losses. Other workers wait for the holder; a dead holder's lease is taken over.
    ``reference_launches`` says, before the reference is obtained, how many launches it will take (1 unless
    it is cached): the study records it, and ``budget.max_launches`` counts it."""
    lease = SetupLease(study, key=reference_key(spec), worker=worker)
    announced = False
    while not lease.ready():
        if lease.acquire():
            stop = threading.Event()
            refresher = threading.Thread(target=_refresh, args=(lease, stop), daemon=True)
            refresher.start()
            try:
                if CREATED_ATTR not in study.user_attrs:
                    study.set_user_attr(CREATED_ATTR, now_utc().isoformat())
                enqueued = seed_study(study, spec, space)
                _say(worker, f"setting up the study: {enqueued} candidate(s) enqueued, FP32 reference run")
                launches = reference_launches()
                study.set_user_attr("reference_losses", reference())
                study.set_user_attr(REFERENCE_LAUNCHES_ATTR, launches)
                study.set_user_attr("reference_key", lease.key)
                lease.finish()
            finally:
                stop.set()
                refresher.join()
            break
        if not announced:
            _say(worker, f"waiting for {lease.holder()} to set the study up")
            announced = True
        time.sleep(wait_s)
    return list(study.user_attrs["reference_losses"])


def _fail_stale(study: optuna.Study) -> None:
    """Optuna's ``fail_stale_trials`` (experimental since 2.9; stable in practice): fail the trials of dead
    workers and run the retry callback."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def _refresh(lease: SetupLease, stop: threading.Event) -> None:
    while not stop.wait(LEASE_REFRESH_S):
        lease.refresh()


@dataclass(frozen=True, kw_only=True, slots=True)
class StopReason:
    """Why a worker stopped."""

    text: str
    """One line for the user."""
    untried: tuple[Option, ...] = ()
    """Candidates that may fit and were never tried, in launch order (a stop by a limit)."""


WAIT = StopReason(text="every remaining candidate is being run by another worker; waiting")
"""Not a stop: wait for the other workers' trials."""


def run_study(*, spec: StudySpec, storage: str, n_trials: int | None, timeout_s: float | None,
              runner: Callable[[Candidate, list[float]], TrialResult] | None = None,
              parallel: bool = False, reference: Callable[[], list[float]] | None = None,
              sampler: optuna.samplers.BaseSampler | None = None,
              gpus: Sequence[str] | None = None, progress: ProgressMode = ProgressMode.HUMAN) -> optuna.Study:
    """Create or join the study on ``storage`` and run trials until a limit is reached (module doc).

    ``parallel`` (``dsopt worker``): other workers may share the storage, so SQLite is refused.
    ``runner`` and ``reference`` replace the real launches (the search-efficiency benchmark replays recorded
    measurements through them); ``sampler`` replaces Optuna's default (TPE) sampler. ``gpus`` is this worker's
    slice of its node's GPUs (:func:`launchers.trial.run.check_devices`), used by every launch including the
    reference; None: every GPU the process sees. ``progress``: what it prints (:mod:`launchers.study.progress`).
    """
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
    if runner is None:  # DeepSpeed's ops, once per node before any launch; drops what this node cannot build
        spec = prepare_ops(spec=spec, gpus=gpus, worker=worker)
    losses = setup_study(study=study, spec=spec, space=space, worker=worker,
                         reference=reference or (lambda: reference_losses(spec, gpus=gpus)),
                         reference_launches=(lambda: 0) if reference is not None
                         else (lambda: 0 if cached_reference_losses(spec) is not None else 1))
    reference_result = spec.output_dir / "reference" / "result.json"  # the FP32 reference: the first launch
    if runner is None and reference_result.is_file():
        record_result_json(study, json.loads(reference_result.read_text()))
    stated = spec
    spec = study_planning_spec(stated, study)  # the measured device reserve and capacity (results/device_budget.py)
    capacity_said: list[str] = []
    say_capacity(stated, study, said=capacity_said, worker=worker)

    mismatch_said: list[str] = []  # a device unlike hardware.profile: said once
    script_said: list[str] = []  # a script's model unlike the model section: said once

    def launch(candidate: Candidate) -> TrialResult:
        report.started(candidate)
        if runner is not None:
            return runner(candidate, losses)
        step = predicted_speed(candidate, spec=spec, models=current[0])  # calibrated once trials are measured
        result = run_trial(study=spec, candidate=candidate, reference_losses=losses,
                           step_s=None if isinstance(step, str) else step.total_s, gpus=gpus,
                           stop_above=stop_above(spec, candidate, ledger=ledgers.get(candidate.label())))
        say_profile_mismatch(spec, result, said=mismatch_said, worker=worker)
        say_script_model(spec, result, said=script_said, worker=worker)
        record_measured_reserve(study, result)
        record_measured_capacity(study, result)
        say_capacity(stated, study, said=capacity_said, worker=worker)
        return result

    fail_stale = _fail_stale if storage_kind(storage) is StorageKind.POSTGRESQL else None
    gate = LaunchGate(budget=spec.budget, worker=worker, created_at=study.user_attrs.get(CREATED_ATTR),
                      fail_stale=fail_stale)
    base = baseline_candidate(spec.training)
    verdicts = [v for v in (evaluate(candidate=c, model=spec.model, hardware=spec.hardware, training=spec.training)
                            for c in spec.search_space.candidates(base))
                if v.ledger is not None and in_space(v.candidate, space)]
    ledgers = {v.candidate.label(): v.ledger for v in verdicts}  # evaluated once: launch() reads them
    current = [study_models(spec=spec, trials=[], base=base)]
    report = Progress(progress, base=base, target=n_trials, worker=worker)
    try:
        _loop(study, spec=spec, space=space, gate=gate, base=base, verdicts=verdicts, current=current,
              report=report, launch=launch, fail_stale=fail_stale, n_trials=n_trials, timeout_s=timeout_s)
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


def say_capacity(stated: StudySpec, study: optuna.Study, *, said: list[str], worker: str) -> None:
    """Once per worker: the study's gpu_memory is more than the device has (it plans with the device's)."""
    note = None if said else capacity_note(stated.hardware, measured_total_bytes=measured_capacity(study))
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


def worker_launches(trials: Sequence[optuna.trial.FrozenTrial], *, worker: str) -> int:
    """Real launches of this worker's trials (retries included)."""
    return sum(int(t.user_attrs.get(LAUNCHES_ATTR, 1)) for t in active_claims(trials)
               if t.user_attrs.get(WORKER_ATTR) == worker)


def _loop(study: optuna.Study, *, spec: StudySpec, space: Branches, gate: LaunchGate, base: Candidate,
          verdicts: list, current: list[StudyModels], report: Progress, launch: Callable[[Candidate], TrialResult],
          fail_stale: Callable[[optuna.Study], None] | None, n_trials: int | None, timeout_s: float | None) -> None:
    """Run trials until a stop reason (module doc)."""
    objective = make_objective(spec=spec, space=space, runner=launch, gate=gate, models=lambda: current[0],
                               artifact_dir=lambda candidate: str(trial_dir_for(spec, candidate)),
                               after_launch=uploader(default_store_dir(spec.output_dir), warn=report.say))
    start = time.monotonic()
    proposals = 0
    own_reference = int(study.user_attrs.get(REFERENCE_LAUNCHES_ATTR, 0)) \
        if study.user_attrs.get("dsopt_setup", {}).get("worker") == gate.worker else 0
    announced_wait = False
    while True:
        if fail_stale is not None:
            fail_stale(study)
        trials = study.get_trials(deepcopy=False)
        current[0] = _refresh_models(study, spec=spec, trials=trials, base=base)
        ranked = options(spec=spec, space=space, trials=trials, models=current[0], verdicts=verdicts)
        launched = worker_launches(trials, worker=gate.worker) + own_reference
        report.launched(launched)
        stop = _stop_reason(trials=trials, spec=spec, gate=gate, ranked=ranked, launched=launched,
                            n_trials=n_trials, elapsed_s=time.monotonic() - start, timeout_s=timeout_s,
                            reference_launches=int(study.user_attrs.get(REFERENCE_LAUNCHES_ATTR, 0)))
        if stop is WAIT:
            if not announced_wait:
                report.say(WAIT.text)
                announced_wait = True
            time.sleep(WAIT_S)
            continue
        if stop is not None:
            report.say(f"stopping: {stop.text}")
            if stop.untried:  # queued ones too: they were never tried either
                report.say(untried_text(options(spec=spec, space=space, trials=trials, models=current[0],
                                                verdicts=verdicts, include_queued=True)))
            break
        announced_wait = False
        if proposals % EXPLORE_EVERY != EXPLORE_EVERY - 1:  # every third proposal is the sampler's own choice
            _guide(study, space=space, trials=trials, ranked=ranked, models=current[0])
        study.optimize(objective, n_trials=1, catch=(TrialFailed,), callbacks=[report.finished])
        proposals += 1


def _refresh_models(study: optuna.Study, *, spec: StudySpec, trials: list[optuna.trial.FrozenTrial],
                    base: Candidate) -> StudyModels:
    """Refit the study's corrections from its measured trials and store them in the study when they change."""
    models = study_models(spec=spec, trials=trials, base=base)
    attr = models.to_attr()
    if study.user_attrs.get(CALIBRATION_ATTR) != attr:
        study.set_user_attr(CALIBRATION_ATTR, attr)
    return models


def _guide(study: optuna.Study, *, space: Branches, trials: list[optuna.trial.FrozenTrial], ranked: list[Option],
           models: StudyModels) -> None:
    """Enqueue the launch policy's choice (:func:`optimizer.search.next_launch.options`' first) unless a trial is
    already queued."""
    if any(t.state is TrialState.WAITING for t in trials) or not ranked:
        return
    study.enqueue_trial(distribution_params(ranked[0].candidate, space),
                        user_attrs={"enqueued_by": f"{POLICY_MARK} ({models.rates.source})"})


def _stop_reason(*, trials: list[optuna.trial.FrozenTrial], spec: StudySpec, gate: LaunchGate, ranked: list[Option],
                 launched: int, n_trials: int | None, elapsed_s: float, timeout_s: float | None,
                 reference_launches: int = 0) -> StopReason | None:
    """Why to stop, :data:`WAIT` (only candidates in flight elsewhere are left), or None (run a trial). A stop
    by a limit carries the candidates left untried (``ranked``: in launch order)."""
    if n_trials is not None and launched >= n_trials:
        return StopReason(text=f"this worker made its {n_trials} launch(es) (retries and the FP32 reference "
                               "included)", untried=tuple(ranked))
    if timeout_s is not None and elapsed_s >= timeout_s:
        return StopReason(text=f"this worker's --timeout of {timeout_s:g} s has passed", untried=tuple(ranked))
    spent = budget_spent(trials=trials, budget=spec.budget, created_at=gate.created_at, now=now_utc(),
                         reference_launches=reference_launches)
    if spent:
        return StopReason(text=f"the study's budget is spent: {spent}", untried=tuple(ranked))
    if not ranked:
        in_flight = {t.user_attrs.get("label") for t in trials if t.state is TrialState.RUNNING} - final_keys(trials)
        if in_flight or any(t.state is TrialState.WAITING for t in trials):
            return WAIT if not any(t.state is TrialState.WAITING for t in trials) else None
        return StopReason(text=f"the search space is exhausted: every candidate that may fit has a result "
                               f"({len(final_keys(trials))} candidate(s))")
    return None
