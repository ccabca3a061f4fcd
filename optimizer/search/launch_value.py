"""What a launch is worth: expected improvement of the front per expected second of launch (pure).

For an unmeasured candidate c with probability to fit P (:func:`optimizer.search.launch_policy.assess`):

    value(c) = P · gain(c) / cost(c)

**Gain** — two sides of the feasible front measured so far, both relative:

* speed: the expected improvement of the best measured feasible throughput T* (Jones, Schonlau & Welch 1998,
  "Efficient Global Optimization"), with the time model's prediction μ as the median of a log-normal speed —
  speeds are positive and the model errs by factors, not by tokens/s — ln T ~ Normal(ln μ, s²):
  E[max(0, T − T*)] = μ·e^{s²/2}·Φ(d₁) − T*·Φ(d₁ − s), d₁ = (ln(μ/T*) + s²)/s (the log-normal call, as in
  Black–Scholes), divided by T*. s is the model's error in log units for the candidate's *time class* (its ZeRO
  stage, fp32 or 16-bit, and offload): the root mean square of ln(predicted/measured) over the study's measured
  trials, at least :data:`SPEED_ERROR_FLOOR`, where the class was measured twice or more;
  :data:`SPEED_ERROR_UNMEASURED` where it was not (one trial of a class says little of how the others scale: on
  CPU ranks ZeRO-0 bf16 ran 2.3x faster at micro-batch 4 than at 1, fp32 at the same stage 1.04x);
  :data:`SPEED_ERROR_PRIOR` before any calibration (the
  hardware profile's figures). Before anything feasible was measured T* is 0 and the gain is E[T] relative to
  the fastest prediction.
* memory: :data:`MEMORY_WEIGHT` × how far its calibrated need lies below the front's leanest point, as a
  fraction of the budget (the ledger's memory is accurate to a few percent, so no distribution is needed).

A candidate the time model cannot predict even with borrowed figures is valued as if its median were the best
measured speed, with the unmeasured error.

**Cost** — the expected seconds of the launch: P · (o + (w + m)·t) + (1 − P) · (o + w·t), with o the
measured overhead of a launch (process start, DeepSpeed's init, the teardown: the wall time less its steps,
mean over measured trials), w and m the warm-up and measured steps, t the predicted step time. A run over the
budget stops at the end of the warm-up (CPU ranks) or at the step it exceeds (CUDA), so a failed launch costs
the overhead and the warm-up, not the whole trial. Before any measurement the cost is the same for all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import optuna

SPEED_ERROR_PRIOR = 0.30
"""The time model's error (log units) before the study calibrated it: the hardware profile's MFU assumption
(0.4) against published 35–45 % (docs/sources.md) is ±12 %, the offload and communication figures are coarser."""
SPEED_ERROR_UNMEASURED = math.log(2.0)
"""The calibrated model's error (log units) on a time class no measured trial belonged to: a factor of 2 —
on grid-cpu, calibrated on ZeRO 0–2 trials with no ZeRO-0 bf16 one, it put ZeRO-0 bf16 at 11,200 tokens/s where
22,966–25,937 were measured (bf16 at stage 0 goes through FP16_Optimizer, another code path)."""
SPEED_ERROR_FLOOR = 0.15
"""The least error (log units) assumed after calibration in a measured time class: the in-sample error of a fit
understates the error on candidates it has not seen (grid-cpu's Spearman ρ between prediction and measurement
is 0.71–0.94)."""
MEMORY_WEIGHT = 0.25
"""Weight of the front's memory side against its speed side: the study looks for the fastest configuration
that fits; the leanest is worth a quarter as much per unit of relative improvement."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FrontSummary:
    """What the study has measured, as the value of a launch needs it."""

    best_tokens_per_s: float
    """Highest feasible measured throughput (0 before anything feasible)."""
    leanest_bytes: int | None
    """Smallest feasible measured memory objective (bytes per device; None before anything feasible)."""
    speed_error: float
    """The time model's error (log units) in the time classes it measured (module doc)."""
    overhead_s: float
    """Mean seconds of a launch beside its steps (0 before any measurement)."""


def front_summary(trials: Sequence[optuna.trial.FrozenTrial], *, speed_error: float,
                  steps_per_launch: int) -> FrontSummary:
    """The feasible measured points (complete, every constraint ≤ 0) and the launches' overhead: wall time less
    ``steps_per_launch`` (warm-up + measured) median step times, mean over measured trials."""
    feasible = [t for t in trials if t.state is optuna.trial.TrialState.COMPLETE and t.values
                and all(v <= 0 for v in t.constraints.values())]
    overheads = [float(t.user_attrs["wall_s"]) - steps_per_launch * float(t.user_attrs["step_time_s"])
                 for t in trials if "reused_from" not in t.user_attrs and t.user_attrs.get("wall_s")
                 and t.user_attrs.get("step_time_s")]
    return FrontSummary(best_tokens_per_s=max((t.values[1] for t in feasible), default=0.0),
                        leanest_bytes=min((int(t.values[0]) for t in feasible), default=None),
                        speed_error=speed_error,
                        overhead_s=max(0.0, sum(overheads) / len(overheads)) if overheads else 0.0)


def speed_error(pairs: Sequence[tuple[float, float]], *, calibrated: bool) -> float:
    """The time model's error in log units from (predicted, measured) step times of measured trials."""
    if not calibrated or not pairs:
        return SPEED_ERROR_PRIOR
    rms = math.sqrt(sum(math.log(p / m) ** 2 for p, m in pairs if m > 0 and p > 0) / len(pairs))
    return max(SPEED_ERROR_FLOOR, rms)


def expected_improvement(*, median: float, sigma: float, best: float) -> float:
    """E[max(0, T − best)] for ln T ~ Normal(ln median, sigma²) (module doc)."""
    if best <= 0:
        return median * math.exp(sigma ** 2 / 2)
    if sigma <= 0:
        return max(0.0, median - best)
    unit = NormalDist()
    d1 = (math.log(median / best) + sigma ** 2) / sigma
    return median * math.exp(sigma ** 2 / 2) * unit.cdf(d1) - best * unit.cdf(d1 - sigma)


def gain(*, tokens_per_s: float | None, sigma: float, need_bytes: int, budget_bytes: int, front: FrontSummary,
         fastest_predicted: float) -> float:
    """The expected relative improvement of the front (module doc); ``tokens_per_s`` None: not predictable, its
    median taken as the best measured speed; ``sigma``: the model's error for this candidate (log units)."""
    best = front.best_tokens_per_s
    median = tokens_per_s if tokens_per_s is not None else (best or fastest_predicted or 1.0)
    reference = best or fastest_predicted or median
    speed = expected_improvement(median=median, sigma=sigma, best=best) / reference
    memory = 0.0
    if front.leanest_bytes is not None and need_bytes < front.leanest_bytes:
        memory = MEMORY_WEIGHT * (front.leanest_bytes - need_bytes) / budget_bytes
    return speed + memory


def launch_cost_s(*, fit_probability: float, step_s: float | None, warmup_steps: int, measured_steps: int,
                  overhead_s: float) -> float:
    """Expected seconds of the launch (module doc); at least a millisecond so that values stay finite."""
    step = step_s or 0.0
    full = overhead_s + (warmup_steps + measured_steps) * step
    failed = overhead_s + warmup_steps * step
    return max(1e-3, fit_probability * full + (1 - fit_probability) * failed)
