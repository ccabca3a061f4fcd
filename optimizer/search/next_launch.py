"""The next launch: among the candidates that may be launched, the most promising — by the calibrated time model,
or the provisional promise order before it has figures — and the kin of a held one first (pure)."""

from __future__ import annotations

import optuna

from optimizer.ledger.core import Verdict
from optimizer.search.ordering import (
    StudyModels,
    calibrated_verdict_fits,
    launchable,
    memory_family,
    memory_group,
    predicted_speed,
)
from optimizer.search.space import Branches, distribution_params, in_space
from optimizer.study.knobs import Candidate, OffloadDevice
from optimizer.study.study_file import StudySpec


def promise(verdict: Verdict) -> tuple:
    """Ordering of fitting candidates when the throughput model lacks a figure (no hardware profile, no
    calibration yet): no offload, no recomputation, low ZeRO stage (less communication), 16-bit, large
    micro-batch."""
    c = verdict.candidate
    offloads = (c.offload_optimizer is not OffloadDevice.NONE) + (c.offload_param is not OffloadDevice.NONE)
    recompute = {"none": 0, "selective": 1}.get(str(c.checkpointing), 2)
    return (offloads, recompute, int(c.zero_stage), str(c.precision) == "fp32", -c.micro_batch_size)


def next_candidate(*, spec: StudySpec, space: Branches, trials: list[optuna.trial.FrozenTrial],
                   models: StudyModels, verdicts: list[Verdict]) -> Candidate | None:
    """The model's choice for the next launch: among candidates of the space that may be launched (they fit,
    calibrated, within the launch margin: :func:`~optimizer.search.ordering.launchable`), have no result and are not
    queued or running, the one with the highest predicted throughput — or, while the time model has no
    figures, the first in :func:`promise` order. When the most promising fitting candidate is *held* by the
    margin, a launchable candidate of its memory group — else of its family (same stage and offload) — goes
    first instead: its measurement is what earns the held one its margin. None when nothing is left."""
    taken = {t.user_attrs.get("label") for t in trials if t.state is optuna.trial.TrialState.RUNNING}
    queued = [t.params for t in trials if t.state is optuna.trial.TrialState.WAITING]
    done = final_keys(trials)
    options, held = [], []
    for verdict in verdicts:
        candidate = verdict.candidate
        key = candidate.label()
        if verdict.ledger is None or not in_space(candidate, space) or key in taken or key in done \
                or distribution_params(candidate, space) in queued:
            continue
        budget = verdict.ledger.gpu_capacity_bytes
        if launchable(verdict, models=models, key=key, budget_bytes=budget):
            options.append((order_key(verdict, spec=spec, models=models), candidate))
        elif calibrated_verdict_fits(verdict, models=models, key=key, budget_bytes=budget):
            held.append((order_key(verdict, spec=spec, models=models), candidate))
    if not options:
        return None
    best = min(options, key=lambda o: o[0])
    if held and min(held, key=lambda o: o[0])[0] < best[0]:  # the most promising is held: probe its kin
        top = min(held, key=lambda o: o[0])[1]
        for kin in (memory_group, memory_family):
            probes = [o for o in options if kin(o[1]) == kin(top)]
            if probes:
                return min(probes, key=lambda o: o[0])[1]
    return best[1]


def order_key(verdict: Verdict, *, spec: StudySpec, models: StudyModels) -> tuple:
    """Most promising first: predicted throughput where the time model knows it, :func:`promise` order where
    it does not. Once the model is calibrated, a candidate it cannot predict (it needs a figure no measured
    trial exercised: e.g. ZeRO-0's all-reduce when only ZeRO-1/2 ran) comes *before* the predicted ones —
    one launch teaches the model that figure, where ranking the unknown last would leave a whole branch (the
    best, perhaps) to the sampler's chance."""
    speed = predicted_speed(verdict.candidate, spec=spec, models=models)
    if isinstance(speed, str):
        return (0 if models.time_samples else 1, promise(verdict), verdict.candidate.label())
    return (1 if models.time_samples else 0, (-speed.tokens_per_s,), verdict.candidate.label())


def final_keys(trials: list[optuna.trial.FrozenTrial]) -> set[str]:
    """Candidates with a final result: measured, or failed with a classified outcome."""
    return {t.user_attrs["label"] for t in trials if "label" in t.user_attrs and (
        (t.state is optuna.trial.TrialState.COMPLETE and "loss_fidelity" in t.user_attrs)
        or (t.state is optuna.trial.TrialState.FAIL and "outcome" in t.user_attrs))}
