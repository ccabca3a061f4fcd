"""Per-study calibration of the time and memory models from measured trials (pure; numpy only).

**Time.** A measured trial gives the step time t of a known amount of work x (:class:`~optimizer.perf.rates.Work`:
FLOPs by precision, bytes communicated, offload bytes, host parameters, micro-steps per stage). The model is
linear in the seconds-per-unit θ: t ≈ x·θ. Calibration solves

    minimise  Σ_i ((x_i·θ − t_i) / t_i)²  +  λ Σ_k ((θ_k − θ⁰_k) / θ⁰_k)²   subject to θ ≥ 0

— relative errors, so that fast and slow trials weigh alike, pulled towards the hardware profile's θ⁰
where it has one (λ = :data:`PRIOR_WEIGHT`), and towards 0 with a small weight where it has none (the
smallest-norm fit, which is what few measurements support). A feature no measured trial exercises keeps its
prior (or stays unknown). The non-negative least squares is solved exactly by trying every support set of
the exercised features (at most 2¹² small solves).

**Memory.** The ledger's per-rank prediction p and the measured peak m give r = m / p per trial (an OOM
gives the lower bound m = budget + 1 byte); the calibrated prediction is k·p with k the median of r.
Guard: k is lowered, if need be, so that no candidate measured to fit would be predicted not to fit
(k·p ≤ the budget for each of them) — a correction never turns a measured fit into a prune; and
:func:`optimizer.search.launch_policy.assess` never prunes a candidate that was measured to fit.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from optimizer.perf.rates import FEATURES, Rates, Work

PRIOR_WEIGHT = 0.05
"""λ: how strongly a profile figure holds against the measurements (relative units)."""
UNKNOWN_WEIGHT = 1e-4
"""Pull of an unknown figure towards 0 (selects the smallest-norm fit)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeSample:
    """One measured trial for the time model."""

    work: Work
    """What the step did."""
    step_time_s: float
    """Measured seconds per optimizer step."""


def fit_rates(samples: Sequence[TimeSample], *, prior: Rates) -> Rates:
    """Calibrated seconds-per-unit (module doc); the prior unchanged when there are no samples."""
    if not samples:
        return prior
    x = np.array([prior.features(s.work) for s in samples], dtype=float)
    t = np.array([s.step_time_s for s in samples], dtype=float)
    used = [k for k in range(len(FEATURES)) if np.any(x[:, k] > 0)]
    scale = np.array([x[:, k][x[:, k] > 0].mean() if k in used else 1.0 for k in range(len(FEATURES))])
    # Scaled unknowns: u_k = θ_k · scale_k / median(t) (each feature's typical seconds, relative to a step).
    t_ref = float(np.median(t))
    rows, rhs = [], []
    for i in range(len(samples)):
        rows.append([x[i, k] / scale[k] * t_ref / t[i] for k in used])
        rhs.append(1.0)
    for j, k in enumerate(used):
        prior_k = prior.seconds_per[k]
        row = [0.0] * len(used)
        if prior_k:
            u0 = prior_k * scale[k] / t_ref
            row[j] = np.sqrt(PRIOR_WEIGHT) / u0
            rhs.append(np.sqrt(PRIOR_WEIGHT))
        else:
            row[j] = np.sqrt(UNKNOWN_WEIGHT)
            rhs.append(0.0)
        rows.append(row)
    u = _nnls(np.array(rows), np.array(rhs))
    seconds = list(prior.seconds_per)
    for j, k in enumerate(used):
        seconds[k] = float(u[j] * t_ref / scale[k])
    return Rates(seconds_per=tuple(seconds), source=f"calibrated on {len(samples)} trial(s)", overlap_z3=False,
                 flop_factors=prior.flop_factors, step_shares=prior.step_shares,
                 recompute_shares=prior.recompute_shares, engine_factors=prior.engine_factors,
                 pass_factors=prior.pass_factors)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ‖a·u − b‖ subject to u ≥ 0, exactly: the best non-negative least-squares solution over supports."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(b ** 2))
    for size in range(1, n + 1):
        for support in itertools.combinations(range(n), size):
            cols = list(support)
            sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(sol < 0):
                continue
            err = float(np.sum((a[:, cols] @ sol - b) ** 2))
            if err < best_err - 1e-15:
                best = np.zeros(n)
                best[cols] = sol
                best_err = err
    return best


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySample:
    """One measured trial for the memory model."""

    predicted_bytes: int
    """The ledger's per-rank prediction."""
    measured_bytes: int
    """The measured per-rank peak."""
    fits_budget_bytes: int | None
    """The per-rank budget the verdict compares against (None: not compared)."""
    estimated_bytes: int = 0
    """Of ``predicted_bytes``, what the ledger estimates rather than counts (activations, transient buffers)."""


def memory_factor(samples: Sequence[MemorySample]) -> float:
    """k = median(measured / predicted), lowered so that no measured fit would be predicted not to fit."""
    ratios = [s.measured_bytes / s.predicted_bytes for s in samples if s.predicted_bytes > 0 and s.measured_bytes]
    if not ratios:
        return 1.0
    k = statistics.median(ratios)
    for s in samples:
        if s.fits_budget_bytes is not None and s.measured_bytes <= s.fits_budget_bytes and s.predicted_bytes > 0:
            k = min(k, s.fits_budget_bytes / s.predicted_bytes)
    return k
