"""Where a candidate stands before a launch, rule by rule (optimizer/search/launch_policy.py, pure).

The probability to fit is the module's documented law, P = Φ((B − n)·z / m) with z = 2, checked at values worked
by hand from the standard normal table (Φ(2) = 0.97725, Φ(1) = 0.84134, Φ(0) = 0.5, Φ(−1) = 0.15866,
Φ(−2.05375) = 0.02); each standing is placed by choosing the budget around the candidate's need and margin.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from optimizer.ledger.core import Verdict, evaluate
from optimizer.perf.throughput import FEATURES, Rates
from optimizer.search import launch_policy
from optimizer.search.launch_policy import (
    MARGIN_Z,
    MIN_FIT_PROBABILITY,
    SAFE_FIT_PROBABILITY,
    Standing,
    assess,
    fit_probability,
)
from optimizer.search.ordering import MIN_MARGIN, StudyModels, memory_group
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]


def test_the_documented_constants():
    assert MARGIN_Z == 2.0 and MIN_FIT_PROBABILITY == 0.02
    assert abs(SAFE_FIT_PROBABILITY - 0.977250) < 1e-6  # Φ(2), the former veto


@pytest.mark.parametrize(("need", "margin", "budget", "expected"), [
    (90, 10, 100, 0.977250),  # (100 − 90)·2/10 = 2
    (95, 10, 100, 0.841345),  # z = 1
    (100, 10, 100, 0.5),  # at the budget: even odds
    (105, 10, 100, 0.158655),  # z = −1
    (100, 40, 120, 0.841345),  # (120 − 100)·2/40 = 1: the margin scales the error
    (1_000_000, 200_000, 1_000_000, 0.5),
    (100, 1, 100, 0.5),  # a margin of one byte is a margin: even odds at the budget, not a step
])
def test_fit_probability_is_the_normal_law_of_the_margin(need, margin, budget, expected):
    assert fit_probability(need_bytes=need, margin_bytes=margin, budget_bytes=budget) == pytest.approx(expected,
                                                                                                        abs=1e-6)


def test_without_a_margin_the_probability_is_a_step_at_the_budget():
    assert fit_probability(need_bytes=100, margin_bytes=0, budget_bytes=100) == 1.0  # at the budget fits
    assert fit_probability(need_bytes=101, margin_bytes=0, budget_bytes=100) == 0.0
    assert fit_probability(need_bytes=50, margin_bytes=-5, budget_bytes=100) == 1.0  # a negative margin: none
    assert fit_probability(need_bytes=150, margin_bytes=-5, budget_bytes=100) == 0.0


@pytest.fixture(scope="module")
def tiny() -> tuple[Verdict, StudyModels]:
    spec = load_study(ROOT / "studies" / "cpu-tiny.yaml")
    candidate = with_knobs(baseline_candidate(spec.training), {"zero_stage": 2, "precision": "bf16",
                                                               "micro_batch_size": 4})
    verdict = evaluate(candidate=candidate, model=spec.model, hardware=spec.hardware, training=spec.training)
    models = StudyModels(rates=Rates(seconds_per=(None,) * len(FEATURES), source="none"), memory_factors=(),
                         time_samples=0, measured_fits=frozenset())
    return verdict, models


def _at_budget(verdict: Verdict, budget: int) -> Verdict:
    return replace(verdict, ledger=replace(verdict.ledger, gpu_capacity_bytes=budget))


def _placed(tiny, z: float) -> tuple:
    """The verdict at the budget where the training probability is Φ(z): B = n + z·m / 2."""
    verdict, models = tiny
    ledger = verdict.ledger
    need, margin = ledger.training_needed_bytes, models.margin_bytes(verdict)
    assert margin > 0 and ledger.init_needed_bytes < need  # the init phase far under: its probability is 1
    return assess(_at_budget(verdict, round(need + z * margin / 2)), models=models), need, margin


def test_a_candidate_two_margins_clear_is_safe(tiny):
    assessment, need, margin = _placed(tiny, 2.5)
    assert assessment.standing is Standing.SAFE and assessment.launchable
    assert assessment.fit_probability == pytest.approx(0.993790, abs=1e-5)  # Φ(2.5)
    assert (assessment.need_bytes, assessment.margin_bytes) == (need, margin)
    assert assessment.reason.startswith("needs ") and "probability to fit 99%" in assessment.reason


def test_between_the_safe_level_and_the_floor_a_candidate_is_risky(tiny):
    assessment, _, margin = _placed(tiny, 0.0)  # exactly at the budget
    assert assessment.standing is Standing.RISKY and assessment.launchable
    assert assessment.fit_probability == pytest.approx(0.5, abs=2e-5)
    assert assessment.reason.startswith("risky: needs ") and "probability to fit 50%" in assessment.reason
    assert f"margin {margin / 1e6:,.3f} MB" in assessment.reason
    assert (assessment.need_bytes, assessment.margin_bytes) == (tiny[0].ledger.training_needed_bytes, margin)
    # the factor is 1: nothing said of calibration
    assert assessment.reason == f"risky: needs 100.0 % of the budget, margin {margin / 1e6:,.3f} MB; " \
                                "probability to fit 50%"
    assessment, _, _ = _placed(tiny, 1.9)  # just under the safe level Φ(2)
    assert assessment.standing is Standing.RISKY and assessment.fit_probability == pytest.approx(0.971283, abs=1e-4)


def test_under_two_percent_a_candidate_is_pruned(tiny):
    assessment, need, margin = _placed(tiny, -2.2)  # Φ(−2.2) = 0.0139 < 0.02
    assert assessment.standing is Standing.PRUNED and not assessment.launchable
    assert (assessment.need_bytes, assessment.margin_bytes) == (need, margin)
    assert "GPU needs" in assessment.reason  # over the budget: the ledger's own reason
    assert assessment.fit_probability == pytest.approx(0.013903, abs=1e-4)
    assert assessment.reason.startswith("does not fit: ") and assessment.reason.endswith("probability to fit 1%")
    assessment, _, _ = _placed(tiny, -1.9)  # Φ(−1.9) = 0.0287: still risky
    assert assessment.standing is Standing.RISKY


def test_measured_fits_are_certain_and_never_launched_again(tiny):
    verdict, models = tiny
    measured = replace(models, measured_fits=frozenset({verdict.candidate.label()}))
    assessment = assess(_at_budget(verdict, 1), models=measured)  # even a budget it cannot meet: it was measured
    assert (assessment.standing, assessment.fit_probability, assessment.margin_bytes) == (Standing.MEASURED, 1.0, 0)
    assert assessment.need_bytes == verdict.ledger.training_needed_bytes
    assert not assessment.launchable and assessment.reason == "measured to fit"


def test_an_invalid_candidate_names_every_reason(tiny):
    verdict, models = tiny
    invalid = Verdict(candidate=verdict.candidate, ledger=None, invalid_reasons=("no fp16 here", "no NVMe path"))
    assessment = assess(invalid, models=models)
    assert (assessment.standing, assessment.fit_probability, assessment.need_bytes) == (Standing.INVALID, 0.0, 0)
    assert assessment.margin_bytes == 0
    assert assessment.reason == "invalid: no fp16 here; no NVMe path" and not assessment.launchable


def test_an_init_phase_over_the_device_is_pruned_whatever_training_needs(tiny):
    verdict, models = tiny
    ledger = verdict.ledger
    assessment = assess(_at_budget(verdict, ledger.init_needed_bytes - 1), models=models)
    assert assessment.standing is Standing.PRUNED and assessment.fit_probability == 0.0
    assert assessment.margin_bytes == 0 and assessment.need_bytes == ledger.training_needed_bytes
    assert assessment.reason == "does not fit: " + "; ".join(_at_budget(verdict, ledger.init_needed_bytes - 1)
                                                            .ledger.verdict_reasons())
    assert assessment.reason.startswith("does not fit: GPU needs ")


def test_the_init_probability_multiplies_with_its_own_floor_margin(tiny):
    """At a budget equal to the init need (it fits, at even odds: its margin is the 3 % floor) and far above the
    training need, P = 1 · Φ(0) = 0.5 — risky, though training alone would be safe."""
    verdict, models = tiny
    ledger = verdict.ledger
    big_init = replace(verdict, ledger=replace(ledger, gpu_capacity_bytes=10 * ledger.training_needed_bytes))
    init_bytes = big_init.ledger.init_needed_bytes
    budget = big_init.ledger.gpu_capacity_bytes
    # scale the init items so that the init need equals the budget: the training need is far under it
    factor = budget / init_bytes
    items = tuple(replace(i, bytes=round(i.bytes * factor)) if i.phase.value == "init" else i for i in ledger.items)
    scaled = replace(big_init, ledger=replace(big_init.ledger, items=items))
    init_need = scaled.ledger.init_needed_bytes
    assert abs(init_need - budget) <= len(items)  # rounding of the scaled items
    assessment = assess(replace(scaled, ledger=replace(scaled.ledger, gpu_capacity_bytes=init_need)), models=models)
    assert assessment.standing is Standing.RISKY
    assert assessment.fit_probability == pytest.approx(0.5, abs=1e-3)
    assert MIN_MARGIN == 0.03


def test_a_host_that_cannot_hold_it_prunes_it_and_every_reason_is_named(tiny):
    verdict, models = tiny
    spec = load_study(ROOT / "studies" / "cpu-tiny.yaml")
    offloaded = evaluate(candidate=with_knobs(verdict.candidate, {"offload_optimizer": "cpu"}), model=spec.model,
                         hardware=spec.hardware, training=spec.training)
    ledger = offloaded.ledger
    host_only = replace(offloaded, ledger=replace(ledger, host_capacity_bytes=ledger.host_bytes - 1))
    assert host_only.ledger.fits_gpu and host_only.ledger.fits_nvme is True  # the host alone is short
    assessment = assess(host_only, models=models)
    assert (assessment.standing, assessment.fit_probability, assessment.margin_bytes) == (Standing.PRUNED, 0.0, 0)
    assert assessment.need_bytes == ledger.training_needed_bytes
    assert assessment.reason.startswith("does not fit: host needs ") and ";" not in assessment.reason
    both = replace(host_only, ledger=replace(host_only.ledger, gpu_capacity_bytes=1))  # and the device too
    reason = assess(both, models=models).reason
    assert reason.startswith("does not fit: GPU needs ") and "; host needs " in reason


def test_a_calibrated_need_says_its_factor(tiny):
    verdict, models = tiny
    ledger = verdict.ledger
    calibrated = replace(models, memory_factors=((memory_group(verdict.candidate), 1.1),))
    assessment = assess(_at_budget(verdict, 10 * ledger.training_needed_bytes), models=calibrated)
    assert assessment.standing is Standing.SAFE
    assert assessment.need_bytes == round(1.1 * ledger.training_needed_bytes)
    assert " (calibrated: x1.100); probability to fit 100%" in assessment.reason
    doubled = replace(models, memory_factors=((memory_group(verdict.candidate), 2.0),))
    assert "(calibrated: x2.000)" in assess(_at_budget(verdict, 10 * ledger.training_needed_bytes),
                                            models=doubled).reason


def test_a_calibrated_need_far_over_the_budget_is_pruned_though_the_ledger_fits(tiny):
    """The ledger fits (no reason of its own) but its group measured 1.5× it: the calibrated need is then over
    the budget by more than two margins — pruned, saying the calibrated share."""
    verdict, models = tiny
    ledger = verdict.ledger
    fitting = _at_budget(verdict, ledger.gpu_needed_bytes)
    assert fitting.ledger.verdict_reasons() == ()
    calibrated = replace(models, memory_factors=((memory_group(verdict.candidate), 1.5),))
    assessment = assess(fitting, models=calibrated)
    share = 100 * round(1.5 * ledger.training_needed_bytes) / ledger.gpu_needed_bytes
    assert assessment.standing is Standing.PRUNED
    assert assessment.reason == (f"does not fit: device need {share:.1f} % of the budget (calibrated: x1.500); "
                                 f"probability to fit 0%")


def test_exactly_the_floor_is_risky_not_pruned(tiny, monkeypatch):
    """'Under this probability to fit a candidate is pruned': at exactly 0.02 it is not under."""
    verdict, models = tiny
    init_need = verdict.ledger.init_needed_bytes
    assert init_need != verdict.ledger.training_needed_bytes  # the two calls told apart by their need
    monkeypatch.setattr(launch_policy, "fit_probability",
                        lambda *, need_bytes, margin_bytes, budget_bytes: 1.0 if need_bytes == init_need else 0.02)
    assessment = assess(_at_budget(verdict, verdict.ledger.training_needed_bytes), models=models)
    assert assessment.fit_probability == 0.02 and assessment.standing is Standing.RISKY


def test_the_margin_is_said_in_megabytes_to_the_kilobyte():
    spec = load_study(ROOT / "studies" / "llama-7b-8xh100.yaml")
    candidate = with_knobs(baseline_candidate(spec.training), {"zero_stage": 3, "precision": "bf16"})
    verdict = evaluate(candidate=candidate, model=spec.model, hardware=spec.hardware, training=spec.training)
    models = StudyModels(rates=Rates(seconds_per=(None,) * len(FEATURES), source="none"), memory_factors=(),
                         time_samples=0, measured_fits=frozenset())
    need, margin = verdict.ledger.training_needed_bytes, models.margin_bytes(verdict)
    assert margin > 10**9  # gigabytes: a thousandth of a megabyte is a byte-exact check of the unit
    assessment = assess(_at_budget(verdict, need), models=models)
    assert assessment.standing is Standing.RISKY
    shown = f"{margin / 10**6:,.3f}"
    assert f"{margin / (10**6 + 1):,.3f}" != shown  # gigabytes: a unit off by one byte in a million shows
    assert f", margin {shown} MB; " in assessment.reason
