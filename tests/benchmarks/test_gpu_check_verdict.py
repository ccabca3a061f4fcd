"""``benchmarks/gpu_check.py``'s row check: a row passes only when it is ``ok``, both peaks fall in the ledger's
band and the fidelity is there and within tolerance. Figures worked by hand: with UNDER = 5 % and OVER = 10 %, a
ledger of 1,100 MB agrees with measurements from 1,000 MB (ledger 10 % over) to 1,157.89 MB (ledger 5 % under)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from optimizer.results.trial_result import Outcome, RankMeasurement, TrialResult

ROOT = Path(__file__).resolve().parents[2]
MB = 10**6


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def _result(*, train: int | None, init: int | None, fidelity: float | None = 1e-3,
            outcome: Outcome = Outcome.OK) -> TrialResult:
    rank = RankMeasurement(rank=0, peak_allocated_bytes=train, peak_reserved_bytes=None, peak_rss_bytes=0,
                           step_times_s=(0.1,), training_peak_allocated_bytes=train, init_peak_allocated_bytes=init)
    return TrialResult(outcome=outcome, ranks=(rank,), loss_fidelity=fidelity)


LEDGER = SimpleNamespace(training_bytes=1_100 * MB, init_bytes=550 * MB, risk_bytes=0)


def test_the_band_is_the_measurements_the_ledger_agrees_with(gpu_check):
    assert gpu_check.band(1_100 * MB) == (1_000 * MB, 1_157_894_736)  # 1,100/1.1; 1,100/0.95 rounded down


def test_a_risk_widens_the_band_upwards_only(gpu_check):
    # A flatten of 95 MB that some runs hold at the peak: a run holding it may measure up to (1,100 + 95)/0.95.
    assert gpu_check.band(1_100 * MB, 95 * MB) == (1_000 * MB, 1_257_894_736)
    risky = SimpleNamespace(training_bytes=1_100 * MB, init_bytes=550 * MB, risk_bytes=95 * MB)
    assert gpu_check.verdict(ledger=risky, result=_result(train=1_250 * MB, init=550 * MB), tolerance=2e-2) == []
    assert gpu_check.verdict(ledger=risky, result=_result(train=1_260 * MB, init=550 * MB), tolerance=2e-2) == \
        ["training: ledger -12.7% off the measured 1,260 MB"]
    assert gpu_check.verdict(ledger=risky, result=_result(train=999 * MB, init=550 * MB), tolerance=2e-2) == \
        ["training: ledger +10.1% off the measured 999 MB"]


@pytest.mark.parametrize(("train", "init"), [(1_000 * MB, 500 * MB), (1_157 * MB, 578 * MB), (1_100 * MB, 550 * MB)])
def test_peaks_inside_the_band_pass(gpu_check, train, init):
    assert gpu_check.verdict(ledger=LEDGER, result=_result(train=train, init=init), tolerance=2e-2) == []


def test_a_ledger_under_the_measurement_past_the_band_fails(gpu_check):
    problems = gpu_check.verdict(ledger=LEDGER, result=_result(train=1_160 * MB, init=550 * MB), tolerance=2e-2)
    assert problems == ["training: ledger -5.2% off the measured 1,160 MB"]


def test_a_ledger_over_the_measurement_past_the_band_fails(gpu_check):
    problems = gpu_check.verdict(ledger=LEDGER, result=_result(train=1_100 * MB, init=499 * MB), tolerance=2e-2)
    assert problems == ["init: ledger +10.2% off the measured 499 MB"]


def test_a_row_without_a_figure_or_fidelity_fails(gpu_check):
    assert gpu_check.verdict(ledger=LEDGER, result=_result(train=1_100 * MB, init=None), tolerance=2e-2) == \
        ["no measured init peak"]
    assert gpu_check.verdict(ledger=LEDGER, result=_result(train=1_100 * MB, init=550 * MB, fidelity=None),
                             tolerance=2e-2) == ["no fidelity"]
    assert gpu_check.verdict(ledger=LEDGER, result=_result(train=1_100 * MB, init=550 * MB, fidelity=3e-2),
                             tolerance=2e-2) == ["fidelity 3.0e-02 > 2e-02"]


@pytest.mark.parametrize("outcome", [Outcome.OOM, Outcome.NAN, Outcome.UNSUPPORTED, Outcome.CRASH, Outcome.TIMEOUT])
def test_every_other_outcome_fails(gpu_check, outcome):
    assert gpu_check.verdict(ledger=LEDGER, result=_result(train=None, init=None, outcome=outcome),
                             tolerance=2e-2) == [f"outcome {outcome}"]


def test_the_grid_has_every_stage_in_bf16_and_the_fp16_code_paths(gpu_check):
    rows = gpu_check._grid(4)
    bf16 = {(k["zero_stage"], k["checkpointing"]) for m, n, k in rows
            if m == "gpt" and n == 4 and k["precision"] == "bf16"}
    assert bf16 == {(s, c) for s in (0, 2, 3) for c in ("none", "full")}
    assert {k["zero_stage"] for m, _, k in rows if k["precision"] == "fp16"} == {0, 2, 3}
    assert [(m, n) for m, n, _ in rows].count(("gpt", 1)) == 2
    assert len(gpu_check._grid(1)) == 12
