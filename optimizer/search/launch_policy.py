"""Where a candidate stands before a launch — the one place that decides (pure).

Every caller — the objective (what a proposed trial does), the next-launch choice, the stop rule, the stop
message and ``dsopt pareto``'s list of untried candidates — asks :func:`assess`, which says:

* ``invalid`` — no ledger (an impossible combination);
* ``pruned`` — cannot fit: the host or NVMe does not hold it, its init phase is over the device, or its
  calibrated device need is so far over the budget that its probability to fit is under
  :data:`MIN_FIT_PROBABILITY` — never launched;
* ``measured`` — measured to fit already (probability 1; its result is reused, never launched again);
* ``safe`` — probability to fit at least :data:`SAFE_FIT_PROBABILITY`: any proposal (the sampler's too) is
  launched;
* ``risky`` — a lower probability: launched only when the launch policy picks it
  (:func:`optimizer.search.next_launch.next_candidate` prices the risk against the gain); the sampler's proposal
  of it is *held* (not launched, not final, spends no launch).

**The probability to fit.** The ledger's calibrated training need n = k·p (k the memory factor of the
candidate's group) against the budget B, with a normal error whose standard deviation is the launch margin m
(:meth:`optimizer.search.ordering.StudyModels.margin_bytes`: the prior until the candidate's family has earned
its own, the family's worst miss after) read as :data:`MARGIN_Z` standard deviations: P = Φ((B − n)·z / m). The
margin was set to cover the worst miss seen on ~80-row grids, about the 98th percentile, which is z ≈ 2 for a
normal error; so the former veto — launch only with the margin free — is exactly P ≥ Φ(2) = 0.977 =
:data:`SAFE_FIT_PROBABILITY`. The init phase is judged the same way with the :data:`MIN_MARGIN` floor as its
margin, and the two probabilities multiply.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from statistics import NormalDist

from optimizer.ledger.core import Verdict
from optimizer.search.ordering import MIN_MARGIN, StudyModels

MARGIN_Z = 2.0
"""How many standard deviations of the ledger's error the launch margin stands for (module doc)."""
SAFE_FIT_PROBABILITY = NormalDist().cdf(MARGIN_Z)
"""0.977: at least this probability to fit and any proposal is launched (the former launch margin)."""
MIN_FIT_PROBABILITY = 0.02
"""Under this probability to fit a candidate is pruned, never launched: its calibrated need is more than
about four margins' worth over the budget (Φ⁻¹(0.02) = −2.05 standard deviations)."""


class Standing(StrEnum):
    """Where a candidate stands before a launch (module doc)."""

    INVALID = "invalid"
    PRUNED = "pruned"
    MEASURED = "measured"
    SAFE = "safe"
    RISKY = "risky"


@dataclass(frozen=True, kw_only=True, slots=True)
class Assessment:
    """One candidate's standing and its probability to fit."""

    standing: Standing
    """Invalid, pruned, measured (to fit), safe or risky (module doc)."""
    fit_probability: float
    """Probability that its measured device share (training and init) stays within the budget: 0 for
    invalid or pruned-by-host candidates, 1 once measured to fit."""
    need_bytes: int
    """The calibrated training device need per rank: the memory factor × the ledger's (0 when invalid)."""
    margin_bytes: int
    """The launch margin: the ledger's error read as :data:`MARGIN_Z` standard deviations."""
    reason: str
    """Why, in a few words (for a pruned or risky candidate)."""

    @property
    def launchable(self) -> bool:
        """Whether the study may launch it at all (safe or risky)."""
        return self.standing in (Standing.SAFE, Standing.RISKY)


def fit_probability(*, need_bytes: float, margin_bytes: float, budget_bytes: int) -> float:
    """Φ((B − n)·z / m) (module doc); a step at the budget when the margin is 0."""
    if margin_bytes <= 0:
        return 1.0 if need_bytes <= budget_bytes else 0.0
    return NormalDist().cdf((budget_bytes - need_bytes) * MARGIN_Z / margin_bytes)


def assess(verdict: Verdict, *, models: StudyModels) -> Assessment:
    """Where ``verdict``'s candidate stands in a study with these models (module doc)."""
    ledger = verdict.ledger
    if ledger is None:
        return Assessment(standing=Standing.INVALID, fit_probability=0.0, need_bytes=0, margin_bytes=0,
                          reason="invalid: " + "; ".join(verdict.invalid_reasons))
    budget = ledger.gpu_capacity_bytes
    factor = models.memory_factor(verdict.candidate)
    exact_need = factor * ledger.training_needed_bytes
    need = round(exact_need)
    if verdict.candidate.label() in models.measured_fits:
        return Assessment(standing=Standing.MEASURED, fit_probability=1.0, need_bytes=need, margin_bytes=0,
                          reason="measured to fit")
    calibrated = f" (calibrated: x{factor:.3f})" if factor != 1.0 else ""
    if ledger.fits_host is False or ledger.fits_nvme is False or ledger.init_needed_bytes > budget:
        # the init phase is in the device peak (Ledger.peak_phase_at): one over the device is a GPU reason too
        return Assessment(standing=Standing.PRUNED, fit_probability=0.0, need_bytes=need, margin_bytes=0,
                          reason="does not fit: " + "; ".join(ledger.verdict_reasons()))
    margin = models.margin_bytes(verdict)
    p_training = fit_probability(need_bytes=exact_need, margin_bytes=margin, budget_bytes=budget)
    p_init = fit_probability(need_bytes=ledger.init_needed_bytes,
                             margin_bytes=MIN_MARGIN * ledger.init_needed_bytes, budget_bytes=budget)
    p = p_training * p_init
    share = f"{100 * need / budget:.1f} % of the budget"
    if p < MIN_FIT_PROBABILITY:
        over = "; ".join(ledger.verdict_reasons()) or f"device need {share}{calibrated}"
        return Assessment(standing=Standing.PRUNED, fit_probability=p, need_bytes=need, margin_bytes=margin,
                          reason=f"does not fit: {over}; probability to fit {p:.0%}")
    if p < SAFE_FIT_PROBABILITY:
        return Assessment(standing=Standing.RISKY, fit_probability=p, need_bytes=need, margin_bytes=margin,
                          reason=f"risky: needs {share}{calibrated}, margin {margin / 1e6:,.3f} MB; "
                                 f"probability to fit {p:.0%}")
    return Assessment(standing=Standing.SAFE, fit_probability=p, need_bytes=need, margin_bytes=margin,
                      reason=f"needs {share}{calibrated}; probability to fit {p:.0%}")
