"""fp16 dynamic loss scaling in a short trial: a skipped step is data, not a failure (pure).

DeepSpeed's dynamic loss scaler skips the update of a step whose gradients overflowed and halves the scale
once ``hysteresis`` overflows were seen in a row (``runtime/fp16/loss_scaler.py:253-275``,
``DynamicLossScaler.update_scale``); the engine then reports ``was_step_applied() == False``, counts
``skipped_steps`` and leaves the learning-rate schedule alone (``runtime/engine.py:3534-3545``), and the
reported gradient norm of that step is inf. At the minimum scale one more overflow raises ("Current loss
scale already at minimum - cannot decrease scale anymore", ``loss_scaler.py:257-259``). Starting from
2^16 (DeepSpeed's ``initial_scale_power`` default), real LLMs overflow for the first few steps: those are
the scaler finding its level, and a trial that called them NaN would record most fp16 candidates as failures.

So a trial classifies each attempted step (:func:`step_kind`): applied; skipped (an overflow the scaler
absorbed); or non-finite — a NaN/inf loss, a non-finite norm on an applied step, or an overflow with the
scale already at its minimum (collapsed). A skipped step's batch is replayed (the rank program draws each
attempt's batch by the number of updates applied before it), so the k-th update sees the FP32 reference's
k-th batch and every attempt's loss compares with the reference's loss at that index
(:func:`reference_indices`). Skipped steps are not timed into throughput.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

DEEPSPEED_INITIAL_SCALE_POWER = 16
"""DeepSpeed's default ``fp16.initial_scale_power`` (runtime/precision_config.py:135)."""
DEEPSPEED_HYSTERESIS = 2
"""DeepSpeed's default ``fp16.hysteresis`` (runtime/precision_config.py:145)."""
DEEPSPEED_MIN_LOSS_SCALE = 1.0
"""DeepSpeed's default ``fp16.min_loss_scale`` (runtime/precision_config.py:155)."""


class StepKind(StrEnum):
    """What one attempted optimizer step did."""

    APPLIED = "applied"
    SKIPPED = "skipped"
    NONFINITE = "nonfinite"


def step_kind(*, loss: float, grad_norm: float | None, applied: bool, loss_scale: float | None,
              min_loss_scale: float) -> StepKind:
    """Classify one attempted step from what the engine reported after it.

    ``loss_scale`` is the scale after the step (None when not training in fp16): a skip that leaves it at the
    minimum has no room left, and the next overflow would end the run."""
    if not math.isfinite(loss):
        return StepKind.NONFINITE
    if applied:
        return StepKind.APPLIED if grad_norm is None or math.isfinite(grad_norm) else StepKind.NONFINITE
    if loss_scale is None or loss_scale <= min_loss_scale:
        return StepKind.NONFINITE  # not a loss-scaled run, or the scale collapsed to its minimum
    return StepKind.SKIPPED


def min_loss_scale(fp16: Mapping[str, Any] | None) -> float:
    """The minimum loss scale of a DeepSpeed ``fp16`` section (its default when absent)."""
    return float((fp16 or {}).get("min_loss_scale", DEEPSPEED_MIN_LOSS_SCALE))


def skip_allowance(fp16: Mapping[str, Any] | None) -> int:
    """The most overflows a dynamic scaler can absorb before its scale reaches the minimum: ``hysteresis`` per
    halving from 2^initial_scale_power down to ``min_loss_scale`` (0 without dynamic fp16 loss scaling)."""
    if not fp16 or not fp16.get("enabled") or float(fp16.get("loss_scale", 0)) != 0.0:
        return 0
    power = int(fp16.get("initial_scale_power", DEEPSPEED_INITIAL_SCALE_POWER))
    hysteresis = max(1, int(fp16.get("hysteresis", DEEPSPEED_HYSTERESIS)))
    halvings = max(0, power - math.floor(math.log2(max(min_loss_scale(fp16), 1e-30))))
    return hysteresis * (halvings + 1)


def reference_indices(applied: Sequence[bool]) -> list[int]:
    """For each attempted step, the updates applied before it: the index of the reference loss it matches."""
    out, done = [], 0
    for was_applied in applied:
        out.append(done)
        done += bool(was_applied)
    return out
