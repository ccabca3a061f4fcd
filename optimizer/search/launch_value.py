"""What a launch is worth: expected improvement of the front per expected second of launch (pure).

For an unmeasured candidate c with probability to fit P (:func:`optimizer.search.launch_policy.assess`):

    value(c) = P · gain(c) / cost(c)

**Gain** — two sides of the feasible front measured so far, both relative:

* speed: the expected improvement of the best measured feasible throughput T* (Jones, Schonlau & Welch 1998,
  "Efficient Global Optimization", eq. 15): with the prediction T ~ Normal(μ, σ), E[max(0, T − T*)] =
  σ·(z·Φ(z) + φ(z)), z = (μ − T*)/σ, divided by T*. σ = μ·s with s the time model's relative error:
  :data:`SPEED_ERROR_PRIOR` before calibration, afterwards the root mean square of its relative errors on the
  study's measured trials, at least :data:`SPEED_ERROR_FLOOR`. Before anything feasible was measured T* is 0
  and the gain is μ relative to the fastest prediction.
* memory: :data:`MEMORY_WEIGHT` × how far its calibrated need lies below the front's leanest point, as a
  fraction of the budget (the ledger's memory is accurate to a few percent, so no distribution is needed).

A candidate the time model cannot predict (it needs a figure no measured trial exercised) is valued as if it
ran at the best measured speed with the prior error: z = 0, E = σ·φ(0) = 0.4·σ — worth a launch, not a first
launch unless it is safe (:func:`optimizer.search.next_launch.next_candidate` tries safe unknowns first, one
launch teaches the model the figure).

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
"""The time model's relative error before the study calibrated it: the hardware profile's MFU assumption
(0.4) against published 35–45 % (docs/sources.md) is ±12 %, the offload and communication figures are coarser."""
SPEED_ERROR_FLOOR = 0.25
"""The least relative error assumed after calibration: the in-sample error of a fit understates the error on
candidates it has not seen — on grid-cpu, calibrated on eight trials of ZeRO 0–2, the model put ZeRO-0 bf16
at 11,200 tokens/s where 22,966–25,937 were measured (the bf16 path at stage 0 is FP16_Optimizer's, which no
trial had exercised); grid-cpu's Spearman ρ between prediction and measurement is 0.71–0.94."""
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
    """The time model's relative error (module doc)."""
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
    """The relative error of the time model from (predicted, measured) step times of measured trials."""
    if not calibrated or not pairs:
        return SPEED_ERROR_PRIOR
    rms = math.sqrt(sum((p / m - 1) ** 2 for p, m in pairs if m > 0) / len(pairs))
    return max(SPEED_ERROR_FLOOR, rms)


def expected_improvement(*, mean: float, sigma: float, best: float) -> float:
    """E[max(0, X − best)] for X ~ Normal(mean, sigma) (Jones et al. 1998, eq. 15)."""
    if sigma <= 0:
        return max(0.0, mean - best)
    z = (mean - best) / sigma
    unit = NormalDist()
    return sigma * (z * unit.cdf(z) + unit.pdf(z))


def gain(*, tokens_per_s: float | None, need_bytes: int, budget_bytes: int, front: FrontSummary,
         fastest_predicted: float) -> float:
    """The expected relative improvement of the front (module doc); ``tokens_per_s`` None: not predictable."""
    best = front.best_tokens_per_s
    if tokens_per_s is None:  # as if at the best speed, with the model's error: z = 0
        speed = front.speed_error * NormalDist().pdf(0.0)
    else:
        reference = best or fastest_predicted or tokens_per_s
        speed = expected_improvement(mean=tokens_per_s, sigma=front.speed_error * tokens_per_s, best=best) / reference
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
