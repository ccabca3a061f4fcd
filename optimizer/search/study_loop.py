"""The study loop, one worker's: lease → reference → propose → prune → launch → record → stop, in one place.

The decisions it sequences live beside it in this package — the seeds (:func:`optimizer.search.objective.seed_study`),
the calibrated models (:mod:`optimizer.search.ordering`), the launch policy's choice
(:mod:`optimizer.search.next_launch`), the objective that prunes, reuses, launches and records
(:mod:`optimizer.search.objective`), the shared-storage rules (:mod:`optimizer.search.coordination`). What it does
not do is start a process: the caller gives it a **runner** (a candidate in, a measured
:class:`~optimizer.results.trial_result.TrialResult` out) and the reference losses' source, and a report that
prints (:mod:`launchers.study.study_run` supplies the real ones: DeepSpeed launches on this node; the
search-efficiency benchmark supplies recorded measurements).

A worker:

1. sets the study up once per study file (:func:`setup_study`, a setup lease): enqueues the seeds and obtains the
   FP32 reference; the other workers wait for it;
2. per iteration (:func:`run_loop`): fails the trials of dead workers (a heartbeat storage), refits the study's
   models from its measured trials, ranks what may be launched (the launch policy), decides whether to stop
   (:func:`stop_reason`: its ``--n-trials`` launches — retries and the reference included —, ``--timeout``, the
   study's budget, or every candidate that may fit has a result; when only candidates in flight elsewhere are
   left it waits), enqueues the policy's choice on two proposals of three (the third is the sampler's own) and
   runs one proposal through the objective;
3. a stop by a limit lists the candidates left untried, with their predicted speed and probability to fit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import optuna

from optimizer.ledger.core import Verdict
from optimizer.results.trial_result import TrialResult
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
)
from optimizer.search.next_launch import Option, final_keys, options
from optimizer.search.objective import POLICY_MARK, LaunchGate, TrialFailed, make_objective, seed_study
from optimizer.search.ordering import CALIBRATION_ATTR, EXPLORE_EVERY, StudyModels, candidate_of, study_models
from optimizer.search.space import Branches, distribution_params
from optimizer.search.untried import untried_text
from optimizer.study.knobs import Candidate
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import StudySpec

TrialState = optuna.trial.TrialState
WAIT_S = 2.0
"""Poll interval while waiting for another worker (setup, or the last candidates in flight)."""
MEASURED_MARK = f"{POLICY_MARK} (measured by the FP32 reference run)"
"""``enqueued_by`` of a candidate the reference run measured: recorded as a trial with no launch."""


class Report(Protocol):
    """What the loop tells its user (:class:`launchers.study.progress.Progress` prints it)."""

    def say(self, text: str) -> None:
        """One line."""

    def launched(self, launches: int) -> None:
        """This worker's launches so far."""

    def finished(self, study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        """A trial ended (an Optuna callback)."""


@dataclass(kw_only=True, slots=True)
class LoopState:
    """What the loop knows between iterations and the runner reads: the study's calibrated models."""

    models: StudyModels
    """Refitted from the measured trials at the start of every iteration."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StopReason:
    """Why a worker stopped."""

    text: str
    """One line for the user."""
    untried: tuple[Option, ...] = ()
    """Candidates that may fit and were never tried, in launch order (a stop by a limit)."""


WAIT = StopReason(text="every remaining candidate is being run by another worker; waiting")
"""Not a stop: wait for the other workers' trials."""


def setup_study(*, study: optuna.Study, spec: StudySpec, space: Branches, worker: str, key: str,
                reference: Callable[[], list[float]], say: Callable[[str], None], wait_s: float = WAIT_S,
                reference_launches: Callable[[], int] = lambda: 0,
                measured: Callable[[], Sequence[tuple[Candidate, TrialResult]]] = lambda: (),
                seeding: Callable[[], StudySpec] | None = None) -> list[float]:
    """Obtain the FP32 reference losses and seed the study exactly once per study file (setup lease ``key``:
    the reference's identity); returns the reference losses. Other workers wait for the holder; a dead holder's
    lease is taken over. ``reference_launches`` says, before the reference is obtained, how many launches it
    will take (1 unless it is cached): the study records it, and ``budget.max_launches`` counts it.
    ``measured``: the candidates the reference run measured as a trial measures them (its own, where it is in the
    space) with their results, asked once the reference has run: enqueued ahead of the seeds (:data:`MEASURED_MARK`),
    and the seeds are chosen knowing them (:func:`~optimizer.search.objective.seed_study`). ``seeding``: the
    spec the seeds are chosen with, asked once the reference has run (its launch may have probed the machine,
    :mod:`launchers.study.study_run`); default ``spec``."""
    lease = SetupLease(study, key=key, worker=worker)
    announced = False
    while not lease.ready():
        if lease.acquire():
            stop = threading.Event()
            refresher = threading.Thread(target=_refresh, args=(lease, stop), daemon=True)
            refresher.start()
            try:
                if CREATED_ATTR not in study.user_attrs:
                    study.set_user_attr(CREATED_ATTR, now_utc().isoformat())
                say("setting up the study: the FP32 reference run")
                launches = reference_launches()
                study.set_user_attr("reference_losses", reference())
                study.set_user_attr(REFERENCE_LAUNCHES_ATTR, launches)
                known = list(measured())
                for candidate, _ in known:  # first in the queue: recorded before any launch (run_loop)
                    study.enqueue_trial(distribution_params(candidate, space), skip_if_exists=True,
                                        user_attrs={"enqueued_by": MEASURED_MARK, "candidate": candidate.knobs()})
                enqueued = seed_study(study, spec if seeding is None else seeding(), space, measured=known)
                say(f"setting up the study: {enqueued} candidate(s) enqueued")
                study.set_user_attr("reference_key", lease.key)
                lease.finish()
            finally:
                stop.set()
                refresher.join()
            break
        if not announced:
            say(f"waiting for {lease.holder()} to set the study up")
            announced = True
        time.sleep(wait_s)
    return list(study.user_attrs["reference_losses"])


def _refresh(lease: SetupLease, stop: threading.Event) -> None:
    while not stop.wait(LEASE_REFRESH_S):
        lease.refresh()


def worker_launches(trials: Sequence[optuna.trial.FrozenTrial], *, worker: str) -> int:
    """Real launches of this worker's trials (retries included)."""
    return sum(int(t.user_attrs.get(LAUNCHES_ATTR, 1)) for t in active_claims(trials)
               if t.user_attrs.get(WORKER_ATTR) == worker)


def run_loop(study: optuna.Study, *, spec: StudySpec, space: Branches, gate: LaunchGate, verdicts: Sequence[Verdict],
             state: LoopState, report: Report, runner: Callable[[Candidate], TrialResult],
             n_trials: int | None, timeout_s: float | None,
             artifact_dir: Callable[[Candidate], str] | None = None,
             after_launch: Callable[[optuna.Trial], None] | None = None,
             measured: Callable[[Candidate], TrialResult | None] | None = None) -> None:
    """Run trials until a stop reason (module doc). ``verdicts``: the space's valid candidates, evaluated once;
    ``measured``: a result measured outside the study's trials, or None (the FP32 reference run is a whole trial of
    its candidate, :func:`setup_study` queues it first): recorded before anything else, with no launch, so that even
    a study of one launch — the reference — has a measured point."""
    base = baseline_candidate(spec.training)
    objective = make_objective(spec=spec, space=space, runner=runner, gate=gate, models=lambda: state.models,
                               artifact_dir=artifact_dir, after_launch=after_launch, measured=measured)
    while (queue := _waiting(study)) and queue[0].user_attrs.get("enqueued_by") == MEASURED_MARK \
            and measured is not None and measured(candidate_of(queue[0].user_attrs["candidate"], base)) is not None:
        # recorded with no launch; where this worker cannot read the reference's files it stays queued for the loop
        study.optimize(objective, n_trials=1, catch=(TrialFailed,), callbacks=[report.finished])
    start = time.monotonic()
    proposals = 0
    own_reference = int(study.user_attrs.get(REFERENCE_LAUNCHES_ATTR, 0)) \
        if study.user_attrs.get("dsopt_setup", {}).get("worker") == gate.worker else 0
    announced_wait = False
    while True:
        if gate.fail_stale is not None:
            gate.fail_stale(study)
        trials = study.get_trials(deepcopy=False)
        state.models = _refresh_models(study, spec=spec, trials=trials, base=base)
        ranked = options(spec=spec, space=space, trials=trials, models=state.models, verdicts=verdicts)
        launched = worker_launches(trials, worker=gate.worker) + own_reference
        report.launched(launched)
        stop = stop_reason(trials=trials, spec=spec, gate=gate, ranked=ranked, launched=launched,
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
                report.say(untried_text(options(spec=spec, space=space, trials=trials, models=state.models,
                                                verdicts=verdicts, include_queued=True)))
            break
        announced_wait = False
        if proposals % EXPLORE_EVERY != EXPLORE_EVERY - 1:  # every third proposal is the sampler's own choice
            _guide(study, space=space, trials=trials, ranked=ranked, models=state.models)
        study.optimize(objective, n_trials=1, catch=(TrialFailed,), callbacks=[report.finished])
        proposals += 1


def _waiting(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The queue, oldest first (the order Optuna pops it)."""
    return [t for t in study.get_trials(deepcopy=False) if t.state is TrialState.WAITING]


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


def stop_reason(*, trials: list[optuna.trial.FrozenTrial], spec: StudySpec, gate: LaunchGate, ranked: list[Option],
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
