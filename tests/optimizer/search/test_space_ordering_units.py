"""The search space's branches, the value of a launch and the study's calibrated models, checked against figures
worked by hand.

Covered: optimizer/search/space.py (:func:`branches`: ZeRO-3 without a usable parameter placement, the empty-space
error), optimizer/search/launch_value.py (:func:`front_summary`, :func:`launch_cost_s`, :func:`gain`),
optimizer/search/next_launch.py (:func:`options`: the fastest prediction as the reference of the speed gain, a
queued trial's ``fixed_params``) and optimizer/search/ordering.py (:func:`study_models` on OOMs that measured
nothing).

Figures: studies/cpu-tiny.yaml (2 CPU ranks, global batch 8, sequence 64, 2 GiB per rank, 2 warm-up + 3 measured
steps, CPU precisions fp32 and bf16), the formulas of launch_value's module doc (cost P·(o + (w + m)·t) +
(1 − P)·(o + w·t); with nothing feasible measured the speed gain is E[T] = μ·e^{s²/2} over the reference) and of
ordering's docstrings (a nothing-measured OOM counts as budget + 1 bytes; the family's estimated-bytes miss is
(measured − 1.03·predicted) / estimated).
"""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest
import yaml

from optimizer.ledger.core import evaluate
from optimizer.perf.rates import FEATURES, Rates
from optimizer.search.launch_policy import Standing
from optimizer.search.launch_value import FrontSummary, front_summary, gain, launch_cost_s
from optimizer.search.next_launch import options
from optimizer.search.ordering import StudyModels, study_models
from optimizer.search.space import Branches, branches
from optimizer.study.errors import UserError
from optimizer.study.knobs import Candidate, OffloadDevice, Precision, ZeroStage, parse_checkpointing
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]
TrialState = optuna.trial.TrialState
EMPTY_WHY = ("no value left that DeepSpeed and this study's hardware/batch allow: the search space is empty after "
             "validation")


def _small_study(folder: Path, knobs: dict, **hardware):
    raw = yaml.safe_load((ROOT / "studies" / "cpu-tiny.yaml").read_text())
    raw["search_space"] = {"knobs": knobs}
    raw["hardware"].update(hardware)
    path = folder / "cpu-tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_study(path), path


def _candidate(stage: int, precision: str, *, mbs: int = 1) -> Candidate:
    return Candidate(zero_stage=ZeroStage(stage), precision=Precision(precision), micro_batch_size=mbs,
                     checkpointing=parse_checkpointing("none"), offload_optimizer=OffloadDevice.NONE,
                     offload_param=OffloadDevice.NONE)


# --- space.py ------------------------------------------------------------------------------------------------

def test_zero3_without_a_usable_parameter_placement_is_dropped_and_the_rest_kept(tmp_path):
    # offload_param lists only nvme and cpu-tiny names no hardware.nvme_path: ZeRO-3 has no placement left,
    # so only ZeRO-2 stays, which has no parameter offload (none); the unlisted knobs keep cpu-tiny's baseline
    # (fp32, no recomputation, micro-batch 2, no optimizer offload).
    spec, _ = _small_study(tmp_path, {"zero_stage": [2, 3], "offload_param": ["nvme"]})
    assert branches(spec) == Branches(stages=(ZeroStage.GRADIENTS,),
                                      offload_optimizer={ZeroStage.GRADIENTS: (OffloadDevice.NONE,)},
                                      offload_param=(OffloadDevice.NONE,), precision=("fp32",),
                                      checkpointing=("none",), micro_batch_size=(2,))


def test_with_an_nvme_path_zero3_keeps_its_nvme_placement(tmp_path):
    spec, _ = _small_study(tmp_path, {"zero_stage": [2, 3], "offload_param": ["nvme"]}, nvme_path=str(tmp_path))
    space = branches(spec)
    assert space.stages == (ZeroStage.GRADIENTS, ZeroStage.PARAMETERS)
    assert space.offload_param == (OffloadDevice.NVME,)
    assert space.offload_optimizer == {ZeroStage.GRADIENTS: (OffloadDevice.NONE,),
                                       ZeroStage.PARAMETERS: (OffloadDevice.NONE,)}


@pytest.mark.parametrize(("knobs", "key"), [
    ({"precision": ["fp16"]}, "knobs.precision"),  # CPU ranks support fp32 and bf16 only
    ({"micro_batch_size": [3]}, "knobs.micro_batch_size"),  # 8 % (3·2) = 2: no whole number of micro-steps
    ({"zero_stage": [3], "offload_param": ["nvme"]}, "knobs.zero_stage"),  # nvme without hardware.nvme_path
    ({"zero_stage": [0], "offload_optimizer": ["cpu"]}, "knobs.zero_stage"),  # ZeRO-0 cannot offload
    # two knobs empty: the first of zero_stage, precision, micro_batch_size is named
    ({"precision": ["fp16"], "micro_batch_size": [3]}, "knobs.precision"),
])
def test_an_empty_space_names_its_source_the_knob_and_why(tmp_path, knobs, key):
    spec, path = _small_study(tmp_path, knobs)
    with pytest.raises(UserError) as caught:
        branches(spec)
    assert (caught.value.source, caught.value.key, caught.value.why) == (str(path), key, EMPTY_WHY)
    assert str(caught.value) == f"{path}: {key}: {EMPTY_WHY}"


# --- launch_value.py -----------------------------------------------------------------------------------------

def _trial(values, *, attrs=None, system=None, state=TrialState.COMPLETE):
    return optuna.trial.create_trial(state=state, values=values, user_attrs=attrs or {}, system_attrs=system or {})


def test_before_anything_feasible_the_front_is_empty():
    assert front_summary([], speed_error=0.3, steps_per_launch=5) == FrontSummary(
        best_tokens_per_s=0.0, leanest_bytes=None, speed_error=0.3, overhead_s=0.0)
    infeasible = _trial([100.0, 9000.0], system={"constraints:loss_fidelity": 0.01})
    assert front_summary([infeasible], speed_error=0.2, steps_per_launch=5) == FrontSummary(
        best_tokens_per_s=0.0, leanest_bytes=None, speed_error=0.2, overhead_s=0.0)


def test_a_constraint_of_exactly_zero_is_feasible_and_overheads_are_averaged():
    at_limit = _trial([300.0, 700.0], system={"constraints:loss_fidelity": 0.0},
                      attrs={"wall_s": 20.0, "step_time_s": 1.0})  # 20 − 5·1 = 15 s
    under = _trial([800.0, 400.0], system={"constraints:loss_fidelity": -0.2, "constraints:init": -1.0},
                   attrs={"wall_s": 12.0, "step_time_s": 0.4})  # 12 − 5·0.4 = 10 s
    over = _trial([100.0, 9000.0], system={"constraints:loss_fidelity": 0.0, "constraints:init": 1e-9})
    reused = _trial([350.0, 650.0], attrs={"wall_s": 500.0, "step_time_s": 1.0, "reused_from": 0})  # not a launch
    failed = _trial(None, state=TrialState.FAIL)
    front = front_summary([at_limit, under, over, reused, failed], speed_error=0.25, steps_per_launch=5)
    # feasible: at_limit (0 ≤ 0), under and reused (its values are measured ones); T* = 700 and the leanest,
    # 300 bytes, are at_limit's; overhead (15 + 10) / 2 = 12.5 s (the reused trial's wall time is not a launch)
    assert front == FrontSummary(best_tokens_per_s=700.0, leanest_bytes=300, speed_error=0.25, overhead_s=12.5)


def test_a_launch_shorter_than_its_steps_has_no_overhead():
    fast = _trial([1.0, 1.0], attrs={"wall_s": 4.0, "step_time_s": 1.0})  # 4 − 5·1 = −1 s: held at 0
    assert front_summary([fast], speed_error=0.3, steps_per_launch=5).overhead_s == 0.0


def test_launch_cost_is_the_expected_seconds_of_a_full_or_failed_launch():
    # o = 10, t = 2, w = 2, m = 3, P = 0.8: full 10 + 5·2 = 20, failed 10 + 2·2 = 14; 0.8·20 + 0.2·14 = 18.8
    assert launch_cost_s(fit_probability=0.8, step_s=2.0, warmup_steps=2, measured_steps=3,
                         overhead_s=10.0) == pytest.approx(18.8, abs=1e-12)
    # no predicted step time: only the overhead, whatever P (0.5·7 + 0.5·7 = 7)
    assert launch_cost_s(fit_probability=0.5, step_s=None, warmup_steps=2, measured_steps=3,
                         overhead_s=7.0) == pytest.approx(7.0, abs=1e-12)
    assert launch_cost_s(fit_probability=1.0, step_s=None, warmup_steps=2, measured_steps=3,
                         overhead_s=0.0) == 1e-3  # nothing known: the millisecond floor
    # P = 0: the failed launch alone, 1 + 2·0.5 = 2 s
    assert launch_cost_s(fit_probability=0.0, step_s=0.5, warmup_steps=2, measured_steps=3,
                         overhead_s=1.0) == pytest.approx(2.0, abs=1e-12)


def test_gain_adds_a_quarter_of_the_memory_saved_as_a_share_of_the_budget():
    front = FrontSummary(best_tokens_per_s=100.0, leanest_bytes=1000, speed_error=0.2, overhead_s=0.0)
    # sigma 0: the speed side is max(0, μ − T*) / T*: (150 − 100)/100 = 0.5; memory 0.25·(1000 − 600)/2000 = 0.05
    assert gain(tokens_per_s=150.0, sigma=0.0, need_bytes=600, budget_bytes=2000, front=front,
                fastest_predicted=999.0) == pytest.approx(0.55, abs=1e-12)
    # slower than T* and no leaner: nothing to gain
    assert gain(tokens_per_s=80.0, sigma=0.0, need_bytes=1000, budget_bytes=2000, front=front,
                fastest_predicted=999.0) == 0.0
    # nothing measured: E[T] = μ·e^{s²/2} relative to the fastest prediction, 50·e^{0.02}/200 = 0.2550503
    empty = FrontSummary(best_tokens_per_s=0.0, leanest_bytes=None, speed_error=0.2, overhead_s=0.0)
    assert gain(tokens_per_s=50.0, sigma=0.2, need_bytes=1, budget_bytes=2000, front=empty,
                fastest_predicted=200.0) == pytest.approx(0.2550503, abs=1e-7)


# --- next_launch.py ------------------------------------------------------------------------------------------

def _models(**known: float | None) -> StudyModels:
    """Rates where every figure is 0 s except ``known`` (None: unknown); no calibration (time_samples 0)."""
    figures = {name: 0.0 for name in FEATURES} | known
    return StudyModels(rates=Rates(seconds_per=tuple(figures[n] for n in FEATURES), source="test"),
                       memory_factors=(), time_samples=0, measured_fits=frozenset())


@pytest.fixture(scope="module")
def z0_pair(tmp_path_factory):
    """cpu-tiny with micro-batches 2 and 4 at ZeRO-0 fp32, and the two verdicts."""
    spec, _ = _small_study(tmp_path_factory.mktemp("z0"), {"zero_stage": [0], "precision": ["fp32"],
                                                           "micro_batch_size": [2, 4]})
    verdicts = [evaluate(candidate=_candidate(0, "fp32", mbs=mbs), model=spec.model, hardware=spec.hardware,
                         training=spec.training) for mbs in (4, 2)]
    return spec, verdicts


def test_with_nothing_measured_the_speed_gain_is_relative_to_the_fastest_prediction(z0_pair):
    """Only a ZeRO-0 micro-step costs time, 0.1 s. cpu-tiny: 8/(2·b) micro-steps, 8·64 = 512 tokens per step:
    mbs 4 → 0.1 s, 5,120 tokens/s; mbs 2 → 0.2 s, 2,560 tokens/s (the fastest: 5,120). Nothing measured: T* = 0,
    s = 0.30 (the prior), E[T] = μ·e^{0.045} = μ·1.0460279; P = 1 (a few MB of 2 GiB), no overhead, 2 + 3 steps.
    mbs 4: gain 5120·1.0460279/5120 = 1.0460279, cost 5·0.1 = 0.5 s, value 2.0920558;
    mbs 2: gain 2560·1.0460279/5120 = 0.5230140, cost 5·0.2 = 1.0 s, value 0.5230140."""
    spec, verdicts = z0_pair
    ranked = options(spec=spec, space=branches(spec), trials=[], models=_models(micro_steps_z0=0.1),
                     verdicts=verdicts)
    assert [o.candidate.label() for o in ranked] == ["z0 fp32 ckpt=none mbs=4", "z0 fp32 ckpt=none mbs=2"]
    assert [o.value for o in ranked] == pytest.approx([2.0920558, 0.5230140], abs=1e-6)
    assert [o.tokens_per_s for o in ranked] == pytest.approx([5120.0, 2560.0], rel=1e-12)
    assert [(o.assessment.standing, o.assessment.fit_probability) for o in ranked] == [(Standing.SAFE, 1.0)] * 2
    # predicted: ordered by value to 3 significant figures, then promise (no offload, no recompute, z0, fp32, −mbs)
    assert [o.order for o in ranked] == [(1, -2.09, (0, 0, 0, True, -4), "z0 fp32 ckpt=none mbs=4"),
                                         (1, -0.523, (0, 0, 0, True, -2), "z0 fp32 ckpt=none mbs=2")]


def test_with_nothing_predicted_a_borrowed_speed_is_its_own_reference(z0_pair):
    """ZeRO-0's micro-step figure unknown, ZeRO-1's 0.1 s: nothing is predicted, so the safe candidates come in
    promise order, each valued with the figure borrowed (half the higher stage's: 0.05 s per micro-step).
    mbs 4: 1 micro-step, 0.05 s, 10,240 tokens/s; mbs 2: 0.1 s, 5,120 tokens/s. No fastest prediction and
    T* = 0: the reference is the candidate's own median, gain e^{0.045} = 1.0460279 for both;
    cost 5·0.05 = 0.25 s → value 4.1841116; 5·0.1 = 0.5 s → value 2.0920558."""
    spec, verdicts = z0_pair
    ranked = options(spec=spec, space=branches(spec), trials=[],
                     models=_models(micro_steps_z0=None, micro_steps_z1=0.1), verdicts=verdicts)
    assert [o.candidate.label() for o in ranked] == ["z0 fp32 ckpt=none mbs=4", "z0 fp32 ckpt=none mbs=2"]
    assert [o.value for o in ranked] == pytest.approx([4.1841116, 2.0920558], abs=1e-6)
    assert [o.tokens_per_s for o in ranked] == pytest.approx([10240.0, 5120.0], rel=1e-12)
    assert [o.order for o in ranked] == [(0, (0, 0, 0, True, -4), "z0 fp32 ckpt=none mbs=4"),
                                         (0, (0, 0, 0, True, -2), "z0 fp32 ckpt=none mbs=2")]
    assert math.exp(0.3 ** 2 / 2) == pytest.approx(1.0460279, abs=1e-7)  # the table figure used above


def test_a_queued_trial_is_known_by_its_fixed_params(z0_pair):
    """An enqueued trial keeps its parameters in system_attrs["fixed_params"] (its own params still empty):
    micro-batch 4 queued is not offered again unless a stop asks for what is left untried."""
    spec, verdicts = z0_pair
    queued = optuna.trial.create_trial(state=TrialState.WAITING, params={}, distributions={},
                                       system_attrs={"fixed_params": {"micro_batch_size": 4}})
    models = _models(micro_steps_z0=0.1)
    space = branches(spec)
    left = options(spec=spec, space=space, trials=[queued], models=models, verdicts=verdicts)
    assert [o.candidate.label() for o in left] == ["z0 fp32 ckpt=none mbs=2"]
    # alone, mbs 2 is its own fastest prediction: gain e^{0.045}, cost 1.0 s
    assert left[0].value == pytest.approx(1.0460279, abs=1e-6)
    every = options(spec=spec, space=space, trials=[queued], models=models, verdicts=verdicts, include_queued=True)
    assert [o.candidate.label() for o in every] == ["z0 fp32 ckpt=none mbs=4", "z0 fp32 ckpt=none mbs=2"]


def test_a_candidate_not_even_borrowing_can_predict_costs_the_typical_step(tmp_path):
    """ZeRO-0 micro-steps 0.1 s, ZeRO-1 ones free (0 s), the offload figures unknown: ZeRO-1 with the optimizer
    on the CPU has no prediction, and borrowing (no kin: free) leaves it no time at all. It is valued as if as
    fast as the fastest prediction (5,120 tokens/s, z0 mbs 4): gain e^{0.045} = 1.0460279, its step the median
    of the predicted ones, sorted (0.1, 0.2)[2 // 2] = 0.2 s: cost 5·0.2 = 1.0 s, value 1.0460279 — between
    z0 mbs 4 (2.0920558) and z0 mbs 2 (0.5230140), as in the test above."""
    spec, _ = _small_study(tmp_path, {"zero_stage": [0, 1], "offload_optimizer": ["none", "cpu"],
                                      "precision": ["fp32"], "micro_batch_size": [2, 4]})
    offloaded = Candidate(zero_stage=ZeroStage.OPTIMIZER, precision=Precision.FP32, micro_batch_size=2,
                          checkpointing=parse_checkpointing("none"), offload_optimizer=OffloadDevice.CPU,
                          offload_param=OffloadDevice.NONE)
    verdicts = [evaluate(candidate=c, model=spec.model, hardware=spec.hardware, training=spec.training)
                for c in (_candidate(0, "fp32", mbs=4), _candidate(0, "fp32", mbs=2), offloaded)]
    models = _models(micro_steps_z0=0.1, micro_steps_z1=0.0, pcie_bytes=None, host_params=None)
    ranked = options(spec=spec, space=branches(spec), trials=[], models=models, verdicts=verdicts)
    assert [o.candidate.label() for o in ranked] == ["z0 fp32 ckpt=none mbs=4", "z1 fp32 ckpt=none mbs=2 opt->cpu",
                                                     "z0 fp32 ckpt=none mbs=2"]
    assert [o.value for o in ranked] == pytest.approx([2.0920558, 1.0460279, 0.5230140], abs=1e-6)
    assert ranked[1].tokens_per_s is None
    assert ranked[1].order == (1, -1.05, (1, 0, 1, True, -2), "z1 fp32 ckpt=none mbs=2 opt->cpu")


# --- ordering.py ---------------------------------------------------------------------------------------------

def test_ooms_that_measured_nothing_give_their_family_an_estimated_bytes_miss(tmp_path):
    """Two OOMs of ZeRO-0 fp32 (one group, one family), nothing measured: each counts as budget + 1 =
    2^31 + 1 bytes. mbs 1 predicted 2^30 with 2^29 estimated, mbs 2 predicted 1.5·2^30 with 2^30 estimated.
    Ratios: r₁ = (2^31 + 1)/2^30 = 2.0000000009313, r₂ = (2^31 + 1)/(1.5·2^30) = 1.3333333339542; the factor is
    their median (r₁ + r₂)/2 = 1.6666666674428, each strays by |r/k − 1| = 0.2 (2/(1 + 2/3) = 1.2).
    Family under-prediction max(r) − 1 = 1.0000000009313.
    Misses: (2^31 + 1 − 1.03·2^30)/2^29 = 4.0000000018626 − 2.06 = 1.9400000018626,
    (2^31 + 1 − 1.03·1.5·2^30)/2^30 = 2.0000000009313 − 1.545 = 0.4550000009313; two samples: the max counts."""
    spec, _ = _small_study(tmp_path, {"zero_stage": [0], "micro_batch_size": [1, 2]})
    base = baseline_candidate(spec.training)

    def oom(mbs: int, predicted: int, estimated: int):
        c = _candidate(0, "fp32", mbs=mbs)
        return _trial(None, state=TrialState.FAIL, attrs={
            "candidate": c.knobs(), "label": c.label(), "outcome": "oom", "predicted_gpu_needed_bytes": predicted,
            "predicted_estimated_bytes": estimated})

    trials = [oom(1, 2**30, 2**29), oom(2, 3 * 2**29, 2**30)]
    models = study_models(spec=spec, trials=trials, base=base)
    group, family = "z0-fp32-none-optnone-pnone", "z0-optnone-pnone"
    assert [name for name, _ in models.memory_factors] == [group]
    assert models.memory_factors[0][1] == pytest.approx(1.6666666674428, abs=1e-12)
    assert [name for name, _ in models.family_under] == [family]
    assert models.family_under[0][1] == pytest.approx(1.0000000009313, abs=1e-12)
    assert [name for name, _ in models.family_estimate] == [family]
    assert models.family_estimate[0][1] == pytest.approx(1.9400000018626, abs=1e-12)
    assert [name for name, _ in models.group_spreads] == [group]
    assert models.group_spreads[0][1] == pytest.approx(0.2, abs=1e-12)
    assert (models.time_samples, models.measured_fits) == (0, frozenset())
    # one OOM alone is not enough to earn the family its own estimate (EARN_SAMPLES = 2)
    assert study_models(spec=spec, trials=trials[:1], base=base).family_estimate == ()
    # predicted at the budget: (2^31 + 1 − 1.03·2^31)/2^29 = 4.0000000018626 − 4.12 < 0, a miss held at 0
    at_budget = study_models(spec=spec, trials=[oom(1, 2**31, 2**29), oom(2, 2**31, 2**29)], base=base)
    assert at_budget.family_estimate == ((family, 0.0),)
