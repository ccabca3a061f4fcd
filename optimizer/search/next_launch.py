"""The next launch: of the candidates not tried yet, the one whose launch is worth most — expected improvement of
the front per expected second, the risk of running out of memory priced in (pure).

Every candidate of the space that may be launched (:func:`optimizer.search.launch_policy.assess`: safe or risky),
has no final result and is neither queued nor running is an :class:`Option` with its probability to fit, its
predicted speed and step time, and its value (:mod:`optimizer.search.launch_value`). The order:

1. while the time model predicts nothing at all (CPU ranks before three measurements): the safe candidates in
   :func:`promise` order;
2. then the highest value (equal values — within 0.1 % — in :func:`promise` order). A candidate the model cannot
   predict (it needs a figure no measured trial exercised, e.g. ZeRO-3's per-micro-step cost when only ZeRO-0–2
   ran) is predicted with that figure borrowed from its measured kin (:func:`imputed_rates`) and the larger error
   of a time class the study has not measured; a risky candidate has a lower probability, so a lower value: it
   comes late unless what it may gain is large — never excluded while launches remain.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import optuna

from optimizer.ledger.core import Verdict
from optimizer.perf.rates import FEATURES, Rates
from optimizer.search.launch_policy import Assessment, Standing, assess
from optimizer.search.launch_value import (
    SPEED_ERROR_PRIOR,
    SPEED_ERROR_UNMEASURED,
    FrontSummary,
    front_summary,
    gain,
    launch_cost_s,
    speed_error,
)
from optimizer.search.ordering import (
    EARN_SAMPLES,
    StudyModels,
    candidate_of,
    measured_trials,
    predicted_speed,
)
from optimizer.search.space import Branches, distribution_params, in_space
from optimizer.study.knobs import Candidate, OffloadDevice, Precision
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import StudySpec

KIN = {"flops_fp32": ("flops_16bit",), "flops_16bit": ("flops_fp32",), "comm_bytes": ("comm_bytes_z3",),
       "comm_bytes_z3": ("comm_bytes",)}
"""Where an unknown figure is borrowed from: the other precision's FLOP rate, the other collective rate.
Offload, host-optimizer and NVMe figures have no kin: they are taken as free (0 s), which makes the prediction
an upper bound on the candidate's speed (its twin without offload)."""
STAGE_STEPS = ("micro_steps_z0", "micro_steps_z1", "micro_steps_z2", "micro_steps_z3")
"""Per-micro-step cost of each ZeRO stage, lowest first: a higher stage does more per micro-step (gradient
partitioning at 2, parameter gathering at 3), so a known higher stage's cost bounds an unknown lower one's."""


def imputed_rates(rates: Rates) -> Rates:
    """``rates`` with each unknown figure borrowed from its kin (:data:`KIN`); an unknown stage's per-micro-step
    cost is half the nearest higher stage's (all we know is 0 ≤ x ≤ it: the middle of that range), else the
    nearest lower stage's (a lower bound: the highest stage measured so far); a figure without kin is free (0 s).
    Where no figure at all is known the rates stay unknown."""
    known = dict(zip(FEATURES, rates.seconds_per, strict=True))
    filled = dict(known)
    for name, kins in KIN.items():
        if known[name] is None:
            filled[name] = next((known[k] for k in kins if known[k] is not None), None)
    for index, name in enumerate(STAGE_STEPS):
        if known[name] is not None:
            continue
        higher = [known[n] for n in STAGE_STEPS[index + 1:] if known[n] is not None]
        lower = [known[n] for n in reversed(STAGE_STEPS[:index]) if known[n] is not None]
        filled[name] = higher[0] / 2 if higher else (lower[0] if lower else None)
    if all(value is None for value in filled.values()):
        return rates
    return replace(rates, seconds_per=tuple(0.0 if filled[name] is None else filled[name] for name in FEATURES),
                   source=rates.source + ", unknown figures borrowed from kin")


def time_class(candidate: Candidate) -> tuple:
    """Candidates that run the same code path of a step: ZeRO stage, fp32 or 16-bit, offload (checkpointing and
    micro-batch change only the amounts of work the time model counts)."""
    c = candidate
    return (int(c.zero_stage), c.precision is Precision.FP32, str(c.offload_optimizer), str(c.offload_param))


def promise(candidate: Candidate) -> tuple:
    """Ordering of fitting candidates when the throughput model lacks a figure (no hardware profile, no
    calibration yet): no offload, no recomputation, low ZeRO stage (less communication), 16-bit, large
    micro-batch."""
    c = candidate
    offloads = (c.offload_optimizer is not OffloadDevice.NONE) + (c.offload_param is not OffloadDevice.NONE)
    recompute = {"none": 0, "selective": 1}.get(str(c.checkpointing), 2)
    return (offloads, recompute, int(c.zero_stage), str(c.precision) == "fp32", -c.micro_batch_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class Option:
    """An untried candidate the study may launch, and what its launch is worth."""

    candidate: Candidate
    assessment: Assessment
    """Its standing (safe or risky) and probability to fit."""
    tokens_per_s: float | None
    """The (calibrated) time model's throughput (a figure it lacks borrowed from its kin, :func:`imputed_rates`);
    None where even that is unknown."""
    value: float
    """Expected relative improvement of the front per expected second of launch (module doc)."""
    order: tuple
    """Smallest first: the launch order (module doc)."""


def final_keys(trials: Sequence[optuna.trial.FrozenTrial]) -> set[str]:
    """Candidates with a final result: measured (fidelity known or not), or failed with a classified outcome."""
    return {t.user_attrs["label"] for t in trials if "label" in t.user_attrs and (
        (t.state is optuna.trial.TrialState.COMPLETE and "loss_fidelity" in t.user_attrs)
        or (t.state is optuna.trial.TrialState.FAIL and "outcome" in t.user_attrs))}


def summary_of(*, spec: StudySpec, trials: Sequence[optuna.trial.FrozenTrial], models: StudyModels) -> FrontSummary:
    """The front as the value needs it, with the time model's error measured on the study's trials."""
    base = baseline_candidate(spec.training)
    pairs = []
    for t in measured_trials(trials):
        step = predicted_speed(candidate_of(t.user_attrs["candidate"], base), spec=spec, models=models)
        if not isinstance(step, str):
            pairs.append((step.total_s, float(t.user_attrs["step_time_s"])))
    steps = spec.trial.warmup_steps + spec.trial.measured_steps
    return front_summary(trials, speed_error=speed_error(pairs, calibrated=models.time_samples > 0),
                         steps_per_launch=steps)


def options(*, spec: StudySpec, space: Branches, trials: Sequence[optuna.trial.FrozenTrial], models: StudyModels,
            verdicts: Sequence[Verdict], include_queued: bool = False) -> list[Option]:
    """Every candidate of the space that may be launched and has no result, is not running and not queued (unless
    ``include_queued``: what a stop leaves untried), in launch order (module doc)."""
    taken = {t.user_attrs.get("label") for t in trials if t.state is optuna.trial.TrialState.RUNNING}
    queued = [] if include_queued else [  # an enqueued trial keeps its parameters as fixed_params until it runs
        t.system_attrs.get("fixed_params", t.params) for t in trials if t.state is optuna.trial.TrialState.WAITING]
    done = final_keys(trials)
    open_ = []
    for verdict in verdicts:
        candidate = verdict.candidate
        key = candidate.label()
        if verdict.ledger is None or not in_space(candidate, space) or key in taken or key in done \
                or distribution_params(candidate, space) in queued:
            continue
        assessment = assess(verdict, models=models)
        if assessment.launchable:
            open_.append((verdict, assessment))
    if not open_:
        return []
    front = summary_of(spec=spec, trials=trials, models=models)
    predictions = {v.candidate.label(): predicted_speed(v.candidate, spec=spec, models=models) for v, _ in open_}
    known = [p for p in predictions.values() if not isinstance(p, str)]
    borrowed = replace(models, rates=imputed_rates(models.rates))
    base = baseline_candidate(spec.training)
    seen = Counter(time_class(candidate_of(t.user_attrs["candidate"], base)) for t in measured_trials(trials))
    measured_classes = {kind for kind, count in seen.items() if count >= EARN_SAMPLES}  # one may be a lucky one
    imputed = {label: predicted_speed(v.candidate, spec=spec, models=borrowed) if isinstance(p, str) else p
               for (v, _), (label, p) in zip(open_, predictions.items(), strict=True)}
    fastest = max((p.tokens_per_s for p in known), default=0.0)
    typical_step = sorted(p.total_s for p in known)[len(known) // 2] if known else None
    result = []
    for verdict, assessment in open_:
        candidate = verdict.candidate
        step = imputed[candidate.label()]
        tokens = None if isinstance(step, str) else step.tokens_per_s
        if models.time_samples == 0:
            sigma = SPEED_ERROR_PRIOR
        elif time_class(candidate) in measured_classes and not isinstance(predictions[candidate.label()], str):
            sigma = front.speed_error
        else:
            sigma = max(front.speed_error, SPEED_ERROR_UNMEASURED)
        worth = gain(tokens_per_s=tokens, sigma=sigma, need_bytes=assessment.need_bytes,
                     budget_bytes=verdict.ledger.gpu_capacity_bytes, fastest_predicted=fastest, front=front)
        cost = launch_cost_s(fit_probability=assessment.fit_probability,
                             step_s=typical_step if isinstance(step, str) else step.total_s,
                             warmup_steps=spec.trial.warmup_steps, measured_steps=spec.trial.measured_steps,
                             overhead_s=front.overhead_s)
        value = assessment.fit_probability * worth / cost
        first = not known and assessment.standing is Standing.SAFE
        rounded = float(f"{value:.3g}")  # equal within 0.1 % is a tie: the promise order breaks it
        order = (0, promise(candidate), candidate.label()) if first else (1, -rounded, promise(candidate),
                                                                          candidate.label())
        result.append(Option(candidate=candidate, assessment=assessment, tokens_per_s=tokens, value=value,
                             order=order))
    return sorted(result, key=lambda o: o.order)


def next_candidate(*, spec: StudySpec, space: Branches, trials: list[optuna.trial.FrozenTrial],
                   models: StudyModels, verdicts: list[Verdict]) -> Candidate | None:
    """The policy's choice for the next launch (module doc); None when nothing is left to launch."""
    ranked = options(spec=spec, space=space, trials=trials, models=models, verdicts=verdicts)
    return ranked[0].candidate if ranked else None
