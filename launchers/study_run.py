"""Run a study — one process (``dsopt study run``) or one of many workers (``dsopt worker``).

The glue between :mod:`optimizer.search.objective` (pure Optuna logic), :mod:`optimizer.search.coordination`
(shared-storage
rules) and :mod:`launchers.trial` (the launches). A worker:

1. opens the storage and creates or joins the study;
2. sets it up once per study file (setup lease): enqueues the ledger's most promising candidates and runs
   the FP32 reference; the other workers wait for it;
3. runs one trial at a time until its own ``--n-trials``/``--timeout``, the study's global budget, or the
   search space is exhausted (every candidate that fits has a final result). When the only candidates left
   are being launched by other workers it waits instead of sampling. With a heartbeat storage it fails the
   trials of dead workers first (Optuna's ``fail_stale_trials``), which puts them back in the queue.

Progress is one line per finished trial on stderr: the worker, trials measured, reused, pruned, failed,
running, and the best so far.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import optuna

from launchers.artifacts import default_store_dir, uploader
from launchers.progress import Progress, ProgressMode
from launchers.trial import reference_key, reference_losses, run_trial, trial_dir_for
from optimizer.ledger.core import evaluate
from optimizer.results.trial_result import TrialResult
from optimizer.search.coordination import (
    CREATED_ATTR,
    LEASE_REFRESH_S,
    SetupLease,
    budget_spent,
    now_utc,
    worker_id,
)
from optimizer.search.next_launch import final_keys, next_candidate
from optimizer.search.objective import LaunchGate, TrialFailed, make_objective, open_study, seed_study
from optimizer.search.ordering import (
    CALIBRATION_ATTR,
    EXPLORE_EVERY,
    StudyModels,
    calibrated_verdict_fits,
    launchable,
    predicted_speed,
    study_models,
)
from optimizer.search.space import Branches, branches, distribution_params, in_space
from optimizer.search.storage import StorageKind, check_shared_storage, storage_kind
from optimizer.study.knobs import Candidate
from optimizer.study.specs import baseline_candidate
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
                reference: Callable[[], list[float]], wait_s: float = WAIT_S) -> list[float]:
    """Seed the study and obtain the FP32 reference losses exactly once per study file (setup lease);
    returns the reference losses. Other workers wait for the holder; a dead holder's lease is taken over."""
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
                study.set_user_attr("reference_losses", reference())
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
    slice of its node's GPUs (:func:`launchers.trial.check_devices`), used by every launch including the
    reference; None: every GPU the process sees. ``progress``: what it prints (:mod:`launchers.progress`).
    """
    from launchers.study_traces import with_traced_activations

    space = branches(spec)  # validate before anything is written
    if parallel:
        check_shared_storage(storage)
    if storage == default_storage(spec):
        spec.output_dir.mkdir(parents=True, exist_ok=True)  # the SQLite file's folder
    worker = worker_id()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are data: our progress line reports them
    study = open_study(spec=spec, storage=storage, sampler=sampler)
    spec = with_traced_activations(spec)  # once the storage is known to be reachable; cached per study
    losses = setup_study(study=study, spec=spec, space=space, worker=worker,
                         reference=reference or (lambda: reference_losses(spec, gpus=gpus)))

    def launch(candidate: Candidate) -> TrialResult:
        report.started(candidate)
        if runner is not None:
            return runner(candidate, losses)
        step = predicted_speed(candidate, spec=spec, models=current[0])  # calibrated once trials are measured
        return run_trial(study=spec, candidate=candidate, reference_losses=losses,
                         step_s=None if isinstance(step, str) else step.total_s, gpus=gpus)

    fail_stale = _fail_stale if storage_kind(storage) is StorageKind.POSTGRESQL else None
    gate = LaunchGate(budget=spec.budget, worker=worker, created_at=study.user_attrs.get(CREATED_ATTR),
                      fail_stale=fail_stale)
    base = baseline_candidate(spec.training)
    verdicts = [v for v in (evaluate(candidate=c, model=spec.model, hardware=spec.hardware, training=spec.training)
                            for c in spec.search_space.candidates(base))
                if v.ledger is not None and in_space(v.candidate, space)]
    current = [study_models(spec=spec, trials=[], base=base)]
    report = Progress(progress, base=base, target=n_trials, worker=worker)
    try:
        _loop(study, spec=spec, space=space, gate=gate, base=base, verdicts=verdicts, current=current,
              report=report, launch=launch, fail_stale=fail_stale, n_trials=n_trials, timeout_s=timeout_s)
    finally:
        report.close()
    return study


def _loop(study: optuna.Study, *, spec: StudySpec, space: Branches, gate: LaunchGate, base: Candidate,
          verdicts: list, current: list[StudyModels], report: Progress, launch: Callable[[Candidate], TrialResult],
          fail_stale: Callable[[optuna.Study], None] | None, n_trials: int | None, timeout_s: float | None) -> None:
    """Run trials until a stop reason (module doc)."""
    objective = make_objective(spec=spec, space=space, runner=launch, gate=gate, models=lambda: current[0],
                               artifact_dir=lambda candidate: str(trial_dir_for(spec, candidate)),
                               after_launch=uploader(default_store_dir(spec.output_dir), warn=report.say))
    start = time.monotonic()
    ran = 0
    announced_wait = False
    while True:
        if fail_stale is not None:
            fail_stale(study)
        trials = study.get_trials(deepcopy=False)
        current[0] = _refresh_models(study, spec=spec, trials=trials, base=base)
        fitting = {v.candidate.label() for v in verdicts
                   if launchable(v, models=current[0], key=v.candidate.label(),
                                 budget_bytes=v.ledger.gpu_capacity_bytes)}
        held = sum(1 for v in verdicts if v.candidate.label() not in fitting and calibrated_verdict_fits(
            v, models=current[0], key=v.candidate.label(), budget_bytes=v.ledger.gpu_capacity_bytes))
        stop = _stop_reason(trials=trials, spec=spec, gate=gate, fitting=fitting, ran=ran, n_trials=n_trials,
                            elapsed_s=time.monotonic() - start, timeout_s=timeout_s, held=held)
        if stop is WAIT:
            if not announced_wait:
                report.say(WAIT.text)
                announced_wait = True
            time.sleep(WAIT_S)
            continue
        if stop is not None:
            report.say(f"stopping: {stop.text}")
            break
        announced_wait = False
        if ran % EXPLORE_EVERY != EXPLORE_EVERY - 1:  # every third trial is the sampler's own choice
            _guide(study, spec=spec, space=space, trials=trials, models=current[0], verdicts=verdicts)
        study.optimize(objective, n_trials=1, catch=(TrialFailed,), callbacks=[report.finished])
        ran += 1


def _refresh_models(study: optuna.Study, *, spec: StudySpec, trials: list[optuna.trial.FrozenTrial],
                    base: Candidate) -> StudyModels:
    """Refit the study's corrections from its measured trials and store them in the study when they change."""
    models = study_models(spec=spec, trials=trials, base=base)
    attr = models.to_attr()
    if study.user_attrs.get(CALIBRATION_ATTR) != attr:
        study.set_user_attr(CALIBRATION_ATTR, attr)
    return models


def _guide(study: optuna.Study, *, spec: StudySpec, space: Branches, trials: list[optuna.trial.FrozenTrial],
           models: StudyModels, verdicts: list) -> None:
    """Enqueue the model's next choice unless a trial is already queued."""
    if any(t.state is TrialState.WAITING for t in trials):
        return
    choice = next_candidate(spec=spec, space=space, trials=trials, models=models, verdicts=verdicts)
    if choice is not None:
        study.enqueue_trial(distribution_params(choice, space),
                            user_attrs={"enqueued_by": f"model ({models.rates.source})"})


def _stop_reason(*, trials: list[optuna.trial.FrozenTrial], spec: StudySpec, gate: LaunchGate, fitting: set[str],
                 ran: int, n_trials: int | None, elapsed_s: float, timeout_s: float | None,
                 held: int = 0) -> StopReason | None:
    """Why to stop, :data:`WAIT` (only candidates in flight elsewhere are left), or None (run a trial)."""
    if n_trials is not None and ran >= n_trials:
        return StopReason(text=f"this worker ran its {n_trials} trial(s)")
    if timeout_s is not None and elapsed_s >= timeout_s:
        return StopReason(text=f"this worker's --timeout of {timeout_s:g} s has passed")
    spent = budget_spent(trials=trials, budget=spec.budget, created_at=gate.created_at, now=now_utc())
    if spent:
        return StopReason(text=f"the study's budget is spent: {spent}")
    left = fitting - final_keys(trials)
    if not left:
        return StopReason(text=f"the search space is exhausted: all {len(fitting)} candidate(s) that may be "
                               "launched have a result" + (f"; {held} more predicted to fit are held back by the "
                                                            "launch margin (their need is too close to the budget "
                                                            "for what the study has measured of its ledger)"
                                                            if held else ""))
    waiting = any(t.state is TrialState.WAITING for t in trials)
    in_flight = {t.user_attrs.get("label") for t in trials if t.state is TrialState.RUNNING}
    if not waiting and left <= in_flight:
        return WAIT
    return None
