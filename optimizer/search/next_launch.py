"""The next launch: of the candidates not tried yet, the one whose launch is worth most — expected improvement of
the front per expected second, the risk of running out of memory priced in (pure).

Every candidate of the space that may be launched (:func:`optimizer.search.launch_policy.assess`: safe or risky),
has no final result and is neither queued nor running is an :class:`Option` with its probability to fit, its
predicted speed and step time, and its value (:mod:`optimizer.search.launch_value`). The order:

1. while the time model predicts nothing at all (CPU ranks before three measurements): the safe candidates in
   :func:`promise` order;
2. then the highest value (equal values — within 0.1 % — in :func:`promise` order). A candidate the model cannot
   predict (it needs a figure no measured trial exercised, e.g. ZeRO-3's per-micro-step cost when only ZeRO-0–2
   ran) is predicted with that figure borrowed from its nearest measured kin (:func:`imputed_rates`) and the
   prior's larger error; a risky candidate has a lower probability, so a lower value: it comes late unless what
   it may gain is large — never excluded while launches remain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import optuna

from optimizer.ledger.core import Verdict
from optimizer.perf.throughput import FEATURES, Rates
from optimizer.search.launch_policy import Assessment, Standing, assess
from optimizer.search.launch_value import (
    SPEED_ERROR_PRIOR,
    FrontSummary,
    front_summary,
    gain,
    launch_cost_s,
    speed_error,
)
from optimizer.search.ordering import (
    StudyModels,
    candidate_of,
    measured_trials,
    predicted_speed,
)
from optimizer.search.space import Branches, distribution_params, in_space
from optimizer.study.knobs import Candidate, OffloadDevice
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import StudySpec

KIN = {"flops_fp32": ("flops_16bit",), "flops_16bit": ("flops_fp32",), "comm_bytes": ("comm_bytes_z3",),
       "comm_bytes_z3": ("comm_bytes",),
       "micro_steps_z0": ("micro_steps_z1", "micro_steps_z2", "micro_steps_z3"),
       "micro_steps_z1": ("micro_steps_z0", "micro_steps_z2", "micro_steps_z3"),
       "micro_steps_z2": ("micro_steps_z1", "micro_steps_z3", "micro_steps_z0"),
       "micro_steps_z3": ("micro_steps_z2", "micro_steps_z1", "micro_steps_z0")}
"""Where an unknown figure is borrowed from, nearest first: the other precision's FLOP rate, the other
collective rate, the nearest ZeRO stage's per-micro-step cost. Offload, host-optimizer and NVMe figures have no
kin: they stay unknown (the candidate is then valued as if it matched the best measured speed)."""


def imputed_rates(rates: Rates) -> Rates:
    """``rates`` with each unknown figure borrowed from its nearest known kin (:data:`KIN`)."""
    known = dict(zip(FEATURES, rates.seconds_per, strict=True))
    filled = []
    for name in FEATURES:
        value = known[name]
        for kin in KIN.get(name, ()) if value is None else ():
            if known[kin] is not None:
                value = known[kin]
                break
        filled.append(value)
    return replace(rates, seconds_per=tuple(filled), source=rates.source + ", unknown figures borrowed from kin")


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
            verdicts: Sequence[Verdict]) -> list[Option]:
    """Every candidate of the space that may be launched and has no result, is not running and not queued, in
    launch order (module doc)."""
    taken = {t.user_attrs.get("label") for t in trials if t.state is optuna.trial.TrialState.RUNNING}
    queued = [t.params for t in trials if t.state is optuna.trial.TrialState.WAITING]
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
    imputed = {label: predicted_speed(v.candidate, spec=spec, models=borrowed) if isinstance(p, str) else p
               for (v, _), (label, p) in zip(open_, predictions.items(), strict=True)}
    fastest = max((p.tokens_per_s for p in known), default=0.0)
    typical_step = sorted(p.total_s for p in known)[len(known) // 2] if known else None
    result = []
    for verdict, assessment in open_:
        candidate = verdict.candidate
        step = imputed[candidate.label()]
        tokens = None if isinstance(step, str) else step.tokens_per_s
        guessed = isinstance(predictions[candidate.label()], str)
        worth = gain(tokens_per_s=tokens, need_bytes=assessment.need_bytes,
                     budget_bytes=verdict.ledger.gpu_capacity_bytes, fastest_predicted=fastest,
                     front=replace(front, speed_error=SPEED_ERROR_PRIOR) if guessed else front)
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
