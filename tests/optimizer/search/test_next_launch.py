"""The next-launch rules that fill the time model's gaps (optimizer/search/next_launch.py): a figure no measured trial
exercised is borrowed from its kin, and a candidate whose time class the study has not measured is priced with the
larger error. Every expected figure below is worked by hand from the rule in the module's docstring.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from optimizer.ledger.core import evaluate
from optimizer.perf.throughput import FEATURES, Rates
from optimizer.search.next_launch import imputed_rates, options, promise, time_class
from optimizer.search.ordering import StudyModels
from optimizer.search.space import branches
from optimizer.study.knobs import Candidate, OffloadDevice, Precision, ZeroStage, parse_checkpointing
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]


def _rates(**known: float) -> Rates:
    return Rates(seconds_per=tuple(known.get(name) for name in FEATURES), source="test")


def _figures(rates: Rates) -> dict[str, float | None]:
    return dict(zip(FEATURES, rates.seconds_per, strict=True))


def test_an_unknown_figure_is_borrowed_from_its_kin_and_one_without_kin_is_free():
    filled = _figures(imputed_rates(_rates(flops_fp32=2e-12, comm_bytes_z3=3e-9, micro_steps_z2=0.4)))
    assert filled["flops_16bit"] == 2e-12  # the other precision's FLOP rate
    assert filled["comm_bytes"] == 3e-9  # the other collective's rate
    assert filled["pcie_bytes"] == filled["host_params"] == filled["nvme_bytes"] == 0.0  # no kin: free
    # stages 0 and 1: half the nearest higher known stage (0 <= x <= 0.4: the middle); stage 3: the nearest lower
    assert (filled["micro_steps_z0"], filled["micro_steps_z1"], filled["micro_steps_z3"]) == (0.2, 0.2, 0.4)
    assert filled["micro_steps_z2"] == 0.4 and filled["flops_fp32"] == 2e-12 and filled["comm_bytes_z3"] == 3e-9


def test_the_nearest_known_stage_is_the_one_borrowed_from():
    filled = _figures(imputed_rates(_rates(micro_steps_z1=0.1, micro_steps_z3=0.9)))
    # z0: its nearest higher is z1 (0.1), not z3; z2: its nearest higher is z3 (0.9), not its lower neighbour z1
    assert (filled["micro_steps_z0"], filled["micro_steps_z2"]) == (0.05, 0.45)
    filled = _figures(imputed_rates(_rates(micro_steps_z0=0.3, micro_steps_z1=0.5)))
    assert (filled["micro_steps_z2"], filled["micro_steps_z3"]) == (0.5, 0.5)  # nearest lower: z1, not z0


def test_known_figures_are_kept_and_nothing_known_stays_unknown():
    known = _rates(flops_fp32=1e-12, flops_16bit=5e-13, comm_bytes=1e-9, comm_bytes_z3=2e-9)
    filled = _figures(imputed_rates(known))
    assert (filled["flops_fp32"], filled["flops_16bit"], filled["comm_bytes"], filled["comm_bytes_z3"]) == (
        1e-12, 5e-13, 1e-9, 2e-9)
    nothing = _rates()
    assert imputed_rates(nothing) is nothing
    assert "borrowed from kin" in imputed_rates(known).source and "borrowed" not in nothing.source


def _candidate(stage: int, precision: str, *, ckpt: str = "none", mbs: int = 1, offload: str = "none") -> Candidate:
    return Candidate(zero_stage=ZeroStage(stage), precision=Precision(precision), micro_batch_size=mbs,
                     checkpointing=parse_checkpointing(ckpt), offload_optimizer=OffloadDevice(offload),
                     offload_param=OffloadDevice.NONE)


def test_time_class_and_promise_order():
    # checkpointing and micro-batch only change amounts of work: one class
    assert time_class(_candidate(2, "bf16", ckpt="full", mbs=4)) == time_class(_candidate(2, "bf16"))
    assert time_class(_candidate(2, "bf16")) != time_class(_candidate(2, "fp32"))
    assert time_class(_candidate(2, "bf16")) != time_class(_candidate(1, "bf16"))
    assert time_class(_candidate(2, "bf16")) != time_class(_candidate(2, "bf16", offload="cpu"))
    ranked = sorted([_candidate(0, "bf16", offload="cpu"), _candidate(0, "bf16", ckpt="full"),
                     _candidate(1, "bf16", ckpt="selective"), _candidate(1, "bf16"), _candidate(0, "fp32"),
                     _candidate(0, "bf16", mbs=2), _candidate(0, "bf16")], key=promise)
    # no offload, then no recomputation (selective before full), then low stage, then 16-bit, then large micro-batch
    assert [c.label() for c in ranked] == [_candidate(*a, **k).label() for a, k in [
        ((0, "bf16"), {"mbs": 2}), ((0, "bf16"), {}), ((0, "fp32"), {}), ((1, "bf16"), {}),
        ((1, "bf16"), {"ckpt": "selective"}), ((0, "bf16"), {"ckpt": "full"}), ((0, "bf16"), {"offload": "cpu"})]]


@pytest.fixture(scope="module")
def tiny():
    spec = load_study(ROOT / "studies" / "cpu-tiny.yaml")
    base = baseline_candidate(spec.training)
    verdicts = [evaluate(candidate=c, model=spec.model, hardware=spec.hardware, training=spec.training)
                for c in spec.search_space.candidates(base)]
    return spec, verdicts


def test_a_16bit_candidate_is_predicted_at_its_fp32_twins_rate_until_a_16bit_rate_is_known(tiny):
    """Only FLOPs cost time (every other figure 0 s), at a known fp32 rate: a 16-bit candidate does the same FLOPs
    as its fp32 twin (precision changes bytes, not FLOPs), so borrowing the fp32 rate predicts the twin's speed —
    without the kin rule it would have no prediction at all."""
    spec, verdicts = tiny
    known = {name: 0.0 for name in FEATURES if name != "flops_16bit"} | {"flops_fp32": 1e-9}
    models = StudyModels(rates=_rates(**known), memory_factors=(), time_samples=3, measured_fits=frozenset())
    ranked = {o.candidate.label(): o for o in options(spec=spec, space=branches(spec), trials=[], models=models,
                                                       verdicts=verdicts)}
    pairs = [(o, ranked.get(o.candidate.label().replace(" bf16 ", " fp32 "))) for o in ranked.values()
             if o.candidate.precision is Precision.BF16]
    pairs = [(half, full) for half, full in pairs if full is not None]
    assert len(pairs) >= 5
    for half, full in pairs:
        assert half.tokens_per_s is not None and half.tokens_per_s == pytest.approx(full.tokens_per_s, rel=1e-12)
    fastest_flops = 1e-9 / 2  # a 16-bit rate twice as fast, once known, is used as it is
    models = StudyModels(rates=_rates(**known | {"flops_16bit": fastest_flops}), memory_factors=(), time_samples=3,
                         measured_fits=frozenset())
    ranked = {o.candidate.label(): o for o in options(spec=spec, space=branches(spec), trials=[], models=models,
                                                       verdicts=verdicts)}
    for half, full in pairs:
        assert ranked[half.candidate.label()].tokens_per_s == pytest.approx(2 * full.tokens_per_s, rel=1e-12)
