"""The study: Optuna multi-objective search with ledger pruning, reuse and an FP32 fidelity constraint.

Objectives: minimise the memory training measured per device — its reserved peak on CUDA (live tensors on CPU
ranks, less the ledger's host items: one memory holds both there) + the device reserve, the memory that runs
out, init left out — and maximise throughput (tokens/s). A run whose measured device share (training or init)
exceeds the per-device budget is outcome ``oom`` like a run that ran out of memory (:func:`over_budget`; the
ranks stop at that moment when the launch passes them the limits,
:class:`optimizer.results.trial_result.StopAbove`).

Each sampled candidate is judged once by :func:`optimizer.search.launch_policy.assess`: an invalid candidate, or one
that cannot fit, is never launched — PRUNED with the ledger's breakdown and the reason in the trial's user
attributes. A *risky* candidate (a probability to fit under the safe level) is launched only when the launch policy
chose it (the trial was enqueued by it: ``enqueued_by`` starts with ``model``); the sampler's proposal of it is
*held* (PRUNED with ``held`` set: not launched, not final). A candidate already measured in the study is not
launched again: its values are reused.

Loss fidelity is a constraint (``trial.set_constraint``, ≤ 0 feasible: fidelity − tolerance of the precision), and
so is the measured init phase (its reserved peak + device reserve over the device's capacity, relative). A fidelity
that could not be computed (no reference losses) is unknown, never perfect: the constraint is violated
(:data:`UNKNOWN_FIDELITY`), so the trial is neither on the front nor exported. A trial that ends in
``oom``/``nan``/``crash``/``timeout``/``unsupported`` is recorded as FAIL with its outcome, so it never reaches
the front (``study.best_trials`` is Optuna's feasible Pareto front).

Every launch — retries included, and an FP32 reference launched to judge the trial (the reference at its micro-batch
size where dropout draws, :attr:`optimizer.results.trial_result.TrialResult.reference_launches`) — is counted on the
trial (``launches``); ``--n-trials`` and
``budget.max_launches`` count those (:func:`optimizer.search.coordination.launches_used`). An ``invalid`` result
that started no rank (a DeepSpeed op this node cannot build, :mod:`launchers.study.op_prep`) counts none.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna

from optimizer.ledger.core import evaluate
from optimizer.ledger.items import Location
from optimizer.results.report import ledger_json
from optimizer.results.trial_result import Outcome, TrialResult
from optimizer.search import storage as storages  # looked up at call time: a test's guard on open_storage holds
from optimizer.search.coordination import (
    LAUNCHES_ATTR,
    REFERENCE_LAUNCHES_ATTR,
    WORKER_ATTR,
    ClaimOutcome,
    Pause,
    budget_spent,
    now_utc,
    running_elsewhere,
    try_claim,
)
from optimizer.search.launch_policy import Standing, assess
from optimizer.search.next_launch import options
from optimizer.search.ordering import StudyModels, study_models
from optimizer.search.space import Branches, distribution_params, sample_candidate
from optimizer.study.cluster_settings import BudgetSettings
from optimizer.study.knobs import Candidate
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import StudySpec

RETRIED = (Outcome.CRASH, Outcome.TIMEOUT)
"""Outcomes that may be transient (a port race, an NCCL hiccup, a co-tenant): launched again up to
``trial.retries`` times before they stand. OOM, NaN and unsupported are properties of the candidate."""
DIRECTIONS = ("minimize", "maximize")
METRIC_NAMES = ("training memory per device (bytes)", "tokens/s")
"""The objectives' names, as optuna-dashboard and Optuna's plots label their axes (training's device memory:
reserved peak + device reserve, bytes; tokens per second)."""
SEED_ENQUEUE = 3
"""How many of the ledger's most promising candidates are enqueued when a study is created."""
UNKNOWN_FIDELITY = 1.0
"""The loss-fidelity constraint of a trial whose fidelity is unknown: violated (> 0), so never feasible."""
POLICY_MARK = "model"
"""``enqueued_by`` of a trial the launch policy chose (it may launch a risky candidate)."""
SEED_MARK = "seed"
"""``enqueued_by`` of a safe seed."""
RISKY_SEED_MARK = f"{POLICY_MARK} (seed)"
"""``enqueued_by`` of a risky seed: the launch policy's pick (:data:`POLICY_MARK`), launched, not held."""
SEED_FIT_PROBABILITY = 0.8
"""Where the machine's probe ranks every stage before any trial, a seed may be risky down to this probability to
fit. Seeds are chosen together, before any of them has run, so none learns from another's OOM; at 0.8 the three
carry at most 3 × 0.2 = 0.6 expected OOM launches (the probability is conservative: its margin is the recorded
grids' worst miss, about their 98th percentile), inside issue 38's bar of a median of at most 1 per study. Safe
only (0.977), the seeds could not take a best that needs most of the budget: it came 4th on grid-cpu at 3 MB
(docs/benchmarks.md, "Seeds that may be risky")."""


class TrialFailed(Exception):
    """A launched trial ended in oom, nan, crash, timeout or unsupported: Optuna records it as FAIL."""


def seed_study(study: optuna.Study, spec: StudySpec, space: Branches,
               measured: Sequence[tuple[Candidate, TrialResult]] = ()) -> int:
    """Enqueue the first candidates of the launch order with the uncalibrated models
    (:func:`optimizer.search.next_launch.options`), once per study (a study attribute guards it). Where the
    machine's probe timed DeepSpeed's engine at every ZeRO stage of the space (:mod:`optimizer.perf.skeleton`), the
    time model ranks the stages before any trial: the first of the launch order whose probability to fit is at least
    :data:`SEED_FIT_PROBABILITY`, whatever their stages (a risky one is marked as the launch policy's pick). Otherwise
    the safe ones, one per ZeRO stage, the lower stages first: each stage has its own per-micro-step and
    communication figures, and the time model can rank a stage only once it has measured it.

    ``measured``: results measured outside the study's launches — the FP32 reference run, a whole trial of its
    candidate (:mod:`launchers.trial.reference_trial`) — that the study records before its first launch. The seeds
    are chosen knowing them (:func:`measured_as_trials`): the reference's family has measured its ledger error, so
    its margin is its own rather than the prior (a candidate of it near the budget may be safe now), the front has
    the reference's speed to beat, and the reference's candidate is not a seed."""
    if study.user_attrs.get("dsopt_seeded"):
        return 0
    base = baseline_candidate(spec.training)
    candidates = list(spec.search_space.candidates(base))
    verdicts = [evaluate(candidate=c, model=spec.model, hardware=spec.hardware, training=spec.training)
                for c in candidates]
    known = measured_as_trials(spec=spec, space=space, measured=measured)
    models = study_models(spec=spec, trials=known, base=base)
    likely = [o for o in options(spec=spec, space=space, trials=known, models=models, verdicts=verdicts)
              if o.assessment.fit_probability >= SEED_FIT_PROBABILITY]
    probe = spec.hardware.probe
    timed = {f.variant for f in probe.of_kind("engine_micro")} if probe is not None else set()
    ranked = likely
    if not all(f"z{int(c.zero_stage)}" in timed for c in candidates):
        safe = [o for o in likely if o.assessment.standing is Standing.SAFE]
        per_stage: dict[int, object] = {}
        for option in safe:
            per_stage.setdefault(int(option.candidate.zero_stage), option)
        ranked = [per_stage[stage] for stage in sorted(per_stage)] + [o for o in safe if o not in per_stage.values()]
    for option in ranked[:SEED_ENQUEUE]:  # a risky seed is the launch policy's pick: launched, not held
        study.enqueue_trial(distribution_params(option.candidate, space), skip_if_exists=True,
                            user_attrs={"enqueued_by": SEED_MARK if option.assessment.standing is Standing.SAFE
                                        else RISKY_SEED_MARK})
    study.set_user_attr("dsopt_seeded", True)
    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.user_attrs.get("enqueued_by") in (SEED_MARK, RISKY_SEED_MARK))


def measured_as_trials(*, spec: StudySpec, space: Branches,
                       measured: Sequence[tuple[Candidate, TrialResult]]) -> list[optuna.trial.FrozenTrial]:
    """``measured`` as the study will record them — through the objective itself (:func:`make_objective`'s
    ``measured``: no launch), on a scratch in-memory study, so that what the seeds know is exactly what the
    study's first trials will say (budget judged, fidelity constrained, device shares and ledger figures kept)."""
    if not measured:
        return []
    results = {candidate.label(): result for candidate, result in measured}

    def never(candidate: Candidate) -> TrialResult:
        raise AssertionError(f"{candidate.label()}: a measured result is recorded, never launched")

    scratch = optuna.create_study(directions=list(DIRECTIONS))
    objective = make_objective(spec=spec, space=space, runner=never,
                               measured=lambda candidate: results.get(candidate.label()))
    for candidate, _ in measured:
        scratch.enqueue_trial(distribution_params(candidate, space), user_attrs={"enqueued_by": "measured"})
        scratch.optimize(objective, n_trials=1, catch=(TrialFailed,))
    return scratch.get_trials(deepcopy=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchGate:
    """What a launch must pass when several workers share the study (see :mod:`optimizer.search.coordination`)."""

    budget: BudgetSettings = field(default_factory=BudgetSettings)
    """The study's global budget."""
    worker: str = "local"
    """This worker's name (recorded on every trial)."""
    created_at: str | None = None
    """When the study was set up (origin of ``budget.max_hours``)."""
    pause: Pause = field(default_factory=Pause)
    """Random pause between claim attempts and while another worker runs the same candidate."""
    fail_stale: Callable[[optuna.Study], None] | None = None
    """Fails trials whose worker died (Optuna's heartbeat), so that waiting on them ends."""


def make_objective(*, spec: StudySpec, space: Branches, runner: Callable[[Candidate], TrialResult],
                   artifact_dir: Callable[[Candidate], str] | None = None,
                   gate: LaunchGate | None = None,
                   models: Callable[[], StudyModels | None] | None = None,
                   after_launch: Callable[[optuna.Trial], None] | None = None,
                   measured: Callable[[Candidate], TrialResult | None] | None = None) -> Callable[[optuna.Trial],
                                                                                                    tuple]:
    """The objective: invalid → prune; measured already → reuse; measured outside the study's trials (``measured``:
    the FP32 reference run is a whole trial of its candidate) → recorded as a trial with no launch, whatever the
    models predict; predicted not to fit → prune; then the launch gate, then a real trial (``runner``).

    ``artifact_dir`` names where a launched trial keeps its files (recorded as the ``trial_dir`` attribute);
    ``after_launch`` is called with the trial, still running, once its launch returned (ok or not): the
    artifact upload (:mod:`launchers.study.artifacts`; a finished trial can take no artifact).
    A trial that finds the budget spent is PRUNED with ``budget_stop`` set. ``models`` gives the study's
    calibrated models (:mod:`optimizer.search.ordering`): pruning then uses the calibrated memory prediction.
    """
    base = baseline_candidate(spec.training)
    gate = gate or LaunchGate()

    def objective(trial: optuna.Trial) -> tuple[float, float]:
        candidate = sample_candidate(trial, space, base)
        key = candidate.label()
        trial.set_user_attr("candidate", candidate.knobs())
        trial.set_user_attr("label", key)  # the candidate's identity; also what the dashboard shows
        trial.set_user_attr(WORKER_ATTR, gate.worker)
        verdict = evaluate(candidate=candidate, model=spec.model, hardware=spec.hardware, training=spec.training)
        if verdict.ledger is None:
            trial.set_user_attr("pruned_reason", "invalid: " + "; ".join(verdict.invalid_reasons))
            raise optuna.TrialPruned(trial.user_attrs["pruned_reason"])
        ledger = verdict.ledger
        trial.set_user_attr("predicted_bytes", ledger.per_gpu()["total"])
        trial.set_user_attr("predicted_gpu_needed_bytes", ledger.gpu_needed_bytes)
        trial.set_user_attr("predicted_training_needed_bytes", ledger.training_needed_bytes)
        trial.set_user_attr("predicted_init_needed_bytes", ledger.init_needed_bytes)
        trial.set_user_attr("predicted_estimated_bytes", ledger.estimated_bytes)
        host_share = ledger.training_host_share_bytes
        trial.set_user_attr("predicted_host_bytes", host_share)  # CPU ranks: measured with the device's
        init_host_share = (ledger.init_bytes - ledger.init_bytes_at(Location.GPU)) if ledger.device_is_host else 0
        trial.set_user_attr("predicted_init_host_bytes", init_host_share)
        tolerance = spec.trial.tolerance(candidate.precision)
        previous = _finished(trial.study, key, exclude=trial.number)
        if previous is not None:  # measured already: its result stands, whatever the models say now
            return _reuse(trial, previous, tolerance)
        current = models() if models is not None else study_models(spec=spec, trials=[], base=base)
        trial.set_user_attr("memory_factor", current.memory_factor(candidate))
        known = measured(candidate) if measured is not None else None
        if known is None:
            standing = assess(verdict, models=current)
            trial.set_user_attr("fit_probability", standing.fit_probability)
            if standing.standing is Standing.PRUNED:
                trial.set_user_attr("pruned_reason", standing.reason)
                trial.set_user_attr("ledger", ledger_json(ledger))
                raise optuna.TrialPruned(standing.reason)
            chosen = str(trial.user_attrs.get("enqueued_by", "")).startswith(POLICY_MARK)
            if standing.standing is Standing.RISKY and not chosen:
                trial.set_user_attr("held", True)
                trial.set_user_attr("launch_margin_bytes", standing.margin_bytes)
                trial.set_user_attr("pruned_reason", f"held: {standing.reason.removeprefix('risky: ')} — launched "
                                    "when the launch policy prices the risk worth it, not on the sampler's proposal")
                raise optuna.TrialPruned(trial.user_attrs["pruned_reason"])
        previous = _acquire(trial, key, gate)
        if previous is not None:
            return _reuse(trial, previous, tolerance)
        if artifact_dir is not None:
            trial.set_user_attr("trial_dir", artifact_dir(candidate))
        failed: list[dict[str, Any]] = []
        references = 0  # FP32 reference launches made to judge it (TrialResult.reference_launches)
        if known is not None:  # the FP32 reference's own launch, counted as the reference (REFERENCE_LAUNCHES_ATTR)
            result = known
            trial.set_user_attr(LAUNCHES_ATTR, 0)
            trial.set_user_attr("measured_by", "the FP32 reference run")
        else:
            result = runner(candidate)
            # An invalid result started no rank (an op this node cannot build, launchers/study/op_prep.py): no launch;
            # a reference launched to judge it (its micro-batch's, where dropout draws) is one more
            references += result.reference_launches
            own = 0 if result.outcome is Outcome.INVALID and not result.ranks else 1
            trial.set_user_attr(LAUNCHES_ATTR, own + references)
        while result.outcome in RETRIED and len(failed) < spec.trial.retries and known is None:  # maybe transient
            failed.append({"outcome": result.outcome.value, "message": result.message[-300:], "wall_s": result.wall_s})
            trial.set_user_attr("failed_attempts", failed)
            result = runner(candidate)
            references += result.reference_launches
            trial.set_user_attr(LAUNCHES_ATTR, len(failed) + 1 + references)
        if references:
            trial.set_user_attr("reference_launches", references)
        if after_launch is not None:
            after_launch(trial)
        trial.set_user_attr("attempts", len(failed) + 1)
        trial.set_user_attr("outcome", result.outcome.value)
        trial.set_user_attr("wall_s", result.wall_s)
        if result.device_name is not None:  # the GPU the ranks ran on (CPU ranks: none)
            trial.set_user_attr("device", {"name": result.device_name, "total_bytes": result.device_total_bytes})
        if result.outcome is Outcome.OOM and result.ranks:  # stopped over the budget: what it saw is data
            _measured(trial, result, spec=spec, host_share=host_share, init_host_share=init_host_share,
                      capacity=ledger.gpu_capacity_bytes)
            trial.set_user_attr("stopped_at", result.stopped_at)
        if result.outcome is not Outcome.OK:
            trial.set_user_attr("message", result.message[-1000:])
            raise TrialFailed(f"{result.outcome}: {result.message[-300:]}")
        trial.set_user_attr("loss_fidelity", result.loss_fidelity)  # None: unknown, never perfect
        if result.loss_fidelity is None:
            trial.set_user_attr("fidelity_unknown", True)
        trial.set_user_attr("tokens_per_s", result.tokens_per_s)
        trial.set_user_attr("step_time_s", result.step_time_s)
        trial.set_user_attr("skipped_steps", result.skipped_steps)
        trial.set_user_attr("losses", list(result.losses))
        memory, init_need = _measured(trial, result, spec=spec, host_share=host_share,
                                      init_host_share=init_host_share, capacity=ledger.gpu_capacity_bytes)
        over = over_budget(training_bytes=memory, init_bytes=init_need, budget_bytes=ledger.gpu_capacity_bytes)
        if over:
            trial.set_user_attr("outcome", Outcome.OOM.value)
            trial.set_user_attr("message", over)
            raise TrialFailed(f"{Outcome.OOM}: {over}")
        _constrain(trial, fidelity=UNKNOWN_FIDELITY if result.loss_fidelity is None
                   else result.loss_fidelity - tolerance, init_memory=trial.user_attrs["init_memory_excess"])
        return float(memory), float(result.tokens_per_s or 0.0)

    return objective


def _measured(trial: optuna.Trial, result: TrialResult, *, spec: StudySpec, host_share: int, init_host_share: int,
              capacity: int) -> tuple[int, int]:
    """Record a launch's memory measurements; returns (training, init) device shares in bytes."""
    trial.set_user_attr("peak_memory_bytes", result.peak_memory_bytes)
    trial.set_user_attr("peak_reserved_bytes", result.peak_reserved_bytes)
    trial.set_user_attr("init_s", result.init_s)
    trial.set_user_attr("init_peak_memory_bytes", result.init_peak_memory_bytes)
    trial.set_user_attr("init_peak_reserved_bytes", result.init_peak_reserved_bytes)
    trial.set_user_attr("training_peak_memory_bytes", result.training_peak_memory_bytes)
    trial.set_user_attr("training_peak_reserved_bytes", result.training_peak_reserved_bytes)
    reserve = spec.hardware.device_reserve_bytes
    memory = (result.training_device_bytes(device_reserve_bytes=reserve) or 0) - host_share
    trial.set_user_attr("device_share_bytes", memory)
    trial.set_user_attr("memory_objective_bytes", memory)
    init_need = (result.init_device_bytes(device_reserve_bytes=reserve) or 0) - init_host_share
    trial.set_user_attr("init_device_share_bytes", init_need)
    trial.set_user_attr("init_memory_excess", (init_need - capacity) / capacity)
    return memory, init_need


def over_budget(*, training_bytes: int, init_bytes: int, budget_bytes: int) -> str:
    """Why a run that ended ok is an OOM all the same, or '' when it is not: the device share it measured
    (training, or the init phase) exceeds the per-device budget the ledger used. On a GPU that run would have
    run out of memory, or fitted only on a bigger device than the study's; on CPU ranks "out of memory" is
    virtual (host RAM is larger than the budget), so the study applies it."""
    for phase, need in (("training", training_bytes), ("init", init_bytes)):
        if need > budget_bytes:
            return (f"measured {phase} device share {need / 1e6:.3f} MB (10^6 bytes) exceeds the per-device budget "
                    f"{budget_bytes / 1e6:.3f} MB by {100 * (need - budget_bytes) / budget_bytes:.1f} %")
    return ""


def _acquire(trial: optuna.Trial, key: str, gate: LaunchGate) -> optuna.trial.FrozenTrial | None:
    """Pass the launch gate: None when this trial may launch, or a finished trial of the same candidate to
    reuse (another worker ran it meanwhile). Raises TrialPruned (``budget_stop``) when the budget is spent."""
    study = trial.study
    while True:
        trials = study.get_trials(deepcopy=False)
        spent = budget_spent(trials=trials, budget=gate.budget, created_at=gate.created_at, now=now_utc(),
                             reference_launches=int(study.user_attrs.get(REFERENCE_LAUNCHES_ATTR, 0)))
        if spent:
            trial.set_user_attr("budget_stop", True)
            trial.set_user_attr("pruned_reason", f"budget spent: {spent}")
            raise optuna.TrialPruned(trial.user_attrs["pruned_reason"])
        outcome = try_claim(study=study, trial=trial, key=key, worker=gate.worker, budget=gate.budget)
        if outcome is ClaimOutcome.GRANTED:
            return None
        if outcome is ClaimOutcome.BUSY:
            trial.set_user_attr("waited_for_same_candidate", True)
            while running_elsewhere(study.get_trials(deepcopy=False), key, exclude=trial.number):
                gate.pause()
                if gate.fail_stale is not None:
                    gate.fail_stale(study)
            previous = _finished(study, key, exclude=trial.number)
            if previous is not None:
                return previous
        else:
            gate.pause()


def _reuse(trial: optuna.Trial, previous: optuna.trial.FrozenTrial, tolerance: float) -> tuple[float, float]:
    """Record ``previous``'s result on ``trial`` instead of launching again (a failure is reused as one)."""
    trial.set_user_attr("reused_from", previous.number)
    for name in ("outcome", "message", "loss_fidelity", "tokens_per_s", "peak_memory_bytes", "trial_dir",
                 "memory_objective_bytes", "device_share_bytes", "init_memory_excess"):
        if name in previous.user_attrs:
            trial.set_user_attr(name, previous.user_attrs[name])
    if previous.state is optuna.trial.TrialState.FAIL:
        raise TrialFailed(f"{previous.user_attrs['outcome']} (as trial {previous.number})")
    fidelity = previous.user_attrs["loss_fidelity"]
    if fidelity is None:
        trial.set_user_attr("fidelity_unknown", True)
    _constrain(trial, fidelity=UNKNOWN_FIDELITY if fidelity is None else fidelity - tolerance,
               init_memory=previous.user_attrs.get("init_memory_excess", 0.0))
    return tuple(previous.values)  # type: ignore[return-value]


def _constrain(trial: optuna.Trial, *, fidelity: float, init_memory: float) -> None:
    """The constraints (≤ 0 feasible): loss fidelity − the precision's tolerance; the measured init phase's
    device need (reserved peak + device reserve) − the device's capacity, relative to the capacity."""
    trial.set_constraint("loss_fidelity", fidelity)
    trial.set_constraint("init_memory", init_memory)


def _finished(study: optuna.Study, key: str, *, exclude: int) -> optuna.trial.FrozenTrial | None:
    """A trial of the same candidate with a final result: measured, or a classified failure (oom, nan, ...).
    A trial failed because its worker died (no outcome) is not final: the candidate is launched again."""
    for frozen in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,
                                                           optuna.trial.TrialState.FAIL)):
        if frozen.number == exclude or frozen.user_attrs.get("label") != key:
            continue
        if "loss_fidelity" in frozen.user_attrs or (frozen.state is optuna.trial.TrialState.FAIL
                                                    and "outcome" in frozen.user_attrs):
            return frozen
    return None


def open_study(*, spec: StudySpec, storage: str, sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
    """Create or join the study on ``storage`` (a URL, see :mod:`optimizer.search.storage`); UserError if
    unreachable."""
    opened = storages.open_storage(storage, workers=spec.workers)
    try:
        study = optuna.create_study(study_name=spec.name, storage=opened, directions=list(DIRECTIONS),
                                    load_if_exists=True, sampler=sampler)
        if study.metric_names is None:
            with warnings.catch_warnings():  # experimental since Optuna 3.2, unchanged since
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names(list(METRIC_NAMES))
        return study
    except Exception as err:  # sqlalchemy / journal errors differ by backend
        raise storages.storage_error(storage, err) from None


