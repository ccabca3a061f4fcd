"""The ledger's trace choice and risk bytes (optimizer/ledger/activations.py, core.py) and the study's models
(optimizer/search/ordering.py's study_models and StudyModels.to_attr, next_launch.py's summary_of).

Figures, each worked by hand:

* Hand-built ledgers: bytes stated per item, no allocator overhead, no reserve; training's peak at a location is
  its ALWAYS items + the largest transient phase (core.py's training_bytes_at docstring).
* cpu-tiny (studies/cpu-tiny.yaml): 2 CPU ranks, global batch 8, sequence 64, a 2 GiB = 2^31-byte budget per rank,
  2 warm-up + 3 measured steps. Micro-steps per step = 8/(2·mbs) (tests/optimizer/search/test_space_ordering_units.py);
  with every
  rate 0 but the ZeRO-0 micro-step's 0.1 s, mbs 4 takes 1 micro-step = 0.1 s per step.
* study_models' formulas (ordering.py): memory factor = median(measured/predicted), lowered to budget/predicted
  for a measured fit; family_under = max(measured/predicted) − 1; family_estimate (2 or more samples with
  estimated bytes) = max((measured − 1.03·predicted)/estimated, 0); group_spreads = max |measured/(k·predicted) − 1|.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import yaml

from optimizer.ledger.activations import usable_trace
from optimizer.ledger.core import Category, Ledger, LedgerItem, Location, Phase
from optimizer.perf.rates import FEATURES, Rates
from optimizer.search.launch_value import FrontSummary
from optimizer.search.next_launch import summary_of
from optimizer.search.ordering import StudyModels, study_models
from optimizer.study.knobs import Candidate, OffloadDevice, Precision, ZeroStage, parse_checkpointing
from optimizer.study.specs import ActivationSource, baseline_candidate
from optimizer.study.study_file import load_study
from optimizer.study.traced_activation import TracedActivation

ROOT = Path(__file__).resolve().parents[3]
TrialState = optuna.trial.TrialState
BUDGET = 2**31  # cpu-tiny's 2 GiB
GROUP, FAMILY = "z0-fp32-none-optnone-pnone", "z0-optnone-pnone"  # ordering.memory_group / memory_family


def _candidate(stage: int, precision: str, *, mbs: int = 1, ckpt: str = "none") -> Candidate:
    return Candidate(zero_stage=ZeroStage(stage), precision=Precision(precision), micro_batch_size=mbs,
                     checkpointing=parse_checkpointing(ckpt), offload_optimizer=OffloadDevice.NONE,
                     offload_param=OffloadDevice.NONE)


@pytest.fixture(scope="module")
def tiny():
    return load_study(ROOT / "studies" / "cpu-tiny.yaml")


@pytest.fixture(scope="module")
def z0_space(tmp_path_factory):
    """cpu-tiny with ZeRO-0 fp32 at micro-batches 2 and 4."""
    raw = yaml.safe_load((ROOT / "studies" / "cpu-tiny.yaml").read_text())
    raw["search_space"] = {"knobs": {"zero_stage": [0], "precision": ["fp32"], "micro_batch_size": [2, 4]}}
    path = tmp_path_factory.mktemp("z0") / "cpu-tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_study(path)


# --- ledger/activations.py ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("source", "failed_op", "precision", "used"), [
    (ActivationSource.TRACE, None, Precision.BF16, True),
    (ActivationSource.AUTO, None, Precision.BF16, True),
    (ActivationSource.FORMULA, None, Precision.BF16, False),  # traced, but the study asks for the formula
    (ActivationSource.TRACE, "aten::foo", Precision.BF16, False),  # the trace failed
    (ActivationSource.TRACE, None, Precision.FP32, False)])  # no entry for fp32
def test_usable_trace_only_when_asked_for_and_successful(tiny, source, failed_op, precision, used):
    entry = TracedActivation(checkpointing="none", precision=Precision.BF16, points=((2, 1000),),
                             failed_op=failed_op)
    model = replace(tiny.model, activations=source, traced_activations=(entry,))
    got = usable_trace(model, _candidate(0, precision.value, mbs=2))
    assert (got is entry) if used else (got is None)


# --- ledger/core.py -----------------------------------------------------------------------------------------------

def _item(num_bytes: int, phase: Phase, *, location: Location = Location.GPU, sometimes: bool = False) -> LedgerItem:
    return LedgerItem(name="x", category=Category.BUFFERS, location=location, bytes=num_bytes, formula="",
                      source="", phase=phase, sometimes=sometimes)


def _ledger(*, items, risks=(), device_is_host=False) -> Ledger:
    return Ledger(candidate=_candidate(0, "fp32"), ranks_per_node=1, device_is_host=device_is_host,
                  gpu_capacity_bytes=10_000, device_reserve_bytes=0, allocator_overhead=0.0,
                  host_capacity_bytes=None, nvme_capacity_bytes=None, items=tuple(items), risks=tuple(risks))


def test_risk_bytes_count_the_risky_items_of_every_phase():
    """Items: 1000 ALWAYS + 300 BACKWARD; risks: 100 ALWAYS + 500 STEP. Without risks the peak is
    1000 + max(300, 0) = 1300; with them 1100 + max(300, 500) = 1600; risk_bytes = 1600 − 1300 = 300."""
    ledger = _ledger(items=[_item(1000, Phase.ALWAYS), _item(300, Phase.BACKWARD)],
                     risks=[_item(100, Phase.ALWAYS, sometimes=True), _item(500, Phase.STEP, sometimes=True)])
    assert ledger.training_bytes_at(Location.GPU) == 1300
    assert ledger.training_bytes_at(Location.GPU, risks=True) == 1600
    assert ledger.risk_bytes == 300


def test_an_always_live_risk_alone_adds_its_bytes():
    """The triage's case: one ALWAYS GPU risk of 100 B over 1000 ALWAYS + 300 BACKWARD: 1400 − 1300 = 100."""
    ledger = _ledger(items=[_item(1000, Phase.ALWAYS), _item(300, Phase.BACKWARD)],
                     risks=[_item(100, Phase.ALWAYS, sometimes=True)])
    assert ledger.risk_bytes == 100
    assert _ledger(items=[_item(1000, Phase.ALWAYS)]).risk_bytes == 0  # no risks


def test_on_cpu_ranks_risks_count_host_and_device_together():
    """device_is_host: host and GPU share one memory. Items 1000 GPU + 200 HOST ALWAYS, 300 GPU BACKWARD;
    risks 50 HOST ALWAYS: (1250 + 300) − (1200 + 300) = 50."""
    ledger = _ledger(items=[_item(1000, Phase.ALWAYS), _item(200, Phase.ALWAYS, location=Location.HOST),
                            _item(300, Phase.BACKWARD)],
                     risks=[_item(50, Phase.ALWAYS, location=Location.HOST, sometimes=True)], device_is_host=True)
    assert ledger.training_bytes_at((Location.HOST, Location.GPU), risks=True) == 1550
    assert ledger.risk_bytes == 50


# --- ordering.py: study_models ------------------------------------------------------------------------------------

def _measured(*, predicted: int, device: int, mbs: int = 2, estimated: int | None = None):
    c = _candidate(0, "fp32", mbs=mbs)
    attrs = {"candidate": c.knobs(), "label": c.label(), "step_time_s": 0.0, "device_share_bytes": device,
             "predicted_training_needed_bytes": predicted}
    if estimated is not None:
        attrs["predicted_estimated_bytes"] = estimated
    return optuna.trial.create_trial(state=TrialState.COMPLETE, values=[float(device), 1.0], user_attrs=attrs)


def _over_budget(*, predicted: int, device: int, estimated: int, mbs: int):
    c = _candidate(0, "fp32", mbs=mbs)
    return optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={
        "candidate": c.knobs(), "label": c.label(), "outcome": "oom", "device_share_bytes": device,
        "predicted_training_needed_bytes": predicted, "predicted_estimated_bytes": estimated})


def test_one_byte_predicted_and_two_measured(tiny):
    """k = 2/1 = 2 (budget/predicted = 2^31 does not lower it); the group strays by |2/(2·1) − 1| = 0; the family
    is under-predicted by 2/1 − 1 = 1.0; it fits (2 ≤ 2^31); step_time_s 0: no time sample; no estimated bytes."""
    models = study_models(spec=tiny, trials=[_measured(predicted=1, device=2)], base=baseline_candidate(tiny.training))
    assert models.memory_factors == ((GROUP, 2.0),)
    assert models.group_spreads == ((GROUP, 0.0),)
    assert models.family_under == ((FAMILY, 1.0),)
    assert models.family_estimate == ()
    assert (models.time_samples, models.measured_fits) == (0, frozenset({"z0 fp32 ckpt=none mbs=2"}))


def test_one_byte_predicted_and_three_measured(tiny):
    """k = 3; spread 0; family_under = 3/1 − 1 = 2.0."""
    models = study_models(spec=tiny, trials=[_measured(predicted=1, device=3)], base=baseline_candidate(tiny.training))
    assert (models.memory_factors, models.group_spreads, models.family_under) == (
        ((GROUP, 3.0),), ((GROUP, 0.0),), ((FAMILY, 2.0),))


def test_two_over_budget_runs_give_their_family_an_estimated_bytes_miss(tiny):
    """Two runs measured over the 2^31 budget, each predicted 2^31 with 2^29 estimated, measured 3·2^30:
    ratio 3·2^30/2^31 = 1.5 (no fit to lower it): k = 1.5, spread 0, family_under 0.5; miss
    (3·2^30 − 1.03·2^31)/2^29 = 6 − 4.12 = 1.88 each, two samples: family_estimate 1.88."""
    trials = [_over_budget(predicted=BUDGET, device=3 * 2**30, estimated=2**29, mbs=mbs) for mbs in (2, 4)]
    models = study_models(spec=tiny, trials=trials, base=baseline_candidate(tiny.training))
    assert models.memory_factors == ((GROUP, 1.5),)
    assert models.group_spreads == ((GROUP, 0.0),)
    assert models.family_under == ((FAMILY, 0.5),)
    assert [name for name, _ in models.family_estimate] == [FAMILY]
    assert models.family_estimate[0][1] == pytest.approx(1.88, abs=1e-12)
    assert (models.time_samples, models.measured_fits) == (0, frozenset())


def test_an_over_budget_run_below_the_budget_counts_as_just_over_it(tiny):
    """An ``oom`` whose device share (1,000 B) is under the budget is taken as budget + 1 = 2^31 + 1 B. Two such,
    predicted 2^30 with 2^29 estimated: ratio (2^31 + 1)/2^30 = 2.00000000093..., miss
    (2^31 + 1 − 1.03·2^30)/2^29 = 4.0000000018626 − 2.06 = 1.9400000018626."""
    trials = [_over_budget(predicted=2**30, device=1_000, estimated=2**29, mbs=mbs) for mbs in (2, 4)]
    models = study_models(spec=tiny, trials=trials, base=baseline_candidate(tiny.training))
    assert models.memory_factors[0][1] == pytest.approx((2**31 + 1) / 2**30, rel=1e-15)
    assert models.family_estimate[0][1] == pytest.approx(1.9400000018626, abs=1e-12)


# --- ordering.py: StudyModels.to_attr ------------------------------------------------------------------------------

def test_to_attr_names_each_rate_by_its_feature():
    rates = Rates(seconds_per=tuple(float(i) for i in range(len(FEATURES))), source="calibrated on 3 trials")
    models = StudyModels(rates=rates, memory_factors=((GROUP, 1.25),), time_samples=3, measured_fits=frozenset())
    assert models.to_attr() == {
        "seconds_per": {"flops_fp32": 0.0, "flops_16bit": 1.0, "comm_bytes": 2.0, "comm_bytes_z3": 3.0,
                        "pcie_bytes": 4.0, "host_params": 5.0, "nvme_bytes": 6.0, "micro_steps_z0": 7.0,
                        "micro_steps_z1": 8.0, "micro_steps_z2": 9.0, "micro_steps_z3": 10.0, "dequant_bytes": 11.0},
        "source": "calibrated on 3 trials", "memory_factors": {GROUP: 1.25}, "time_samples": 3}


# --- next_launch.py: summary_of -----------------------------------------------------------------------------------

def _models(time_samples: int) -> StudyModels:
    rates = Rates(seconds_per=tuple(0.1 if n == "micro_steps_z0" else 0.0 for n in FEATURES), source="test")
    return StudyModels(rates=rates, memory_factors=(), time_samples=time_samples, measured_fits=frozenset())


def _launched(step_time_s: float):
    c = _candidate(0, "fp32", mbs=4)
    return optuna.trial.create_trial(state=TrialState.COMPLETE, values=[1_000.0, 5_120.0], user_attrs={
        "candidate": c.knobs(), "label": c.label(), "step_time_s": step_time_s, "wall_s": 10.0})


def test_one_calibrated_sample_measures_the_speed_error(z0_space):
    """Predicted 0.1 s (1 micro-step at 0.1 s), measured 0.2 s: rms |ln(0.1/0.2)| = ln 2 = 0.693 > the 0.15
    floor. Feasible front: 5,120 tokens/s, 1,000 B; overhead 10 − 5·0.2 = 9.0 s (2 + 3 steps)."""
    front = summary_of(spec=z0_space, trials=[_launched(0.2)], models=_models(1))
    assert front == FrontSummary(best_tokens_per_s=5120.0, leanest_bytes=1000, speed_error=pytest.approx(math.log(2)),
                                 overhead_s=pytest.approx(9.0))


def test_without_calibration_the_prior_speed_error_stands(z0_space):
    """time_samples 0: the prior 0.30 (launch_value.SPEED_ERROR_PRIOR), whatever was measured."""
    assert summary_of(spec=z0_space, trials=[_launched(0.2)], models=_models(0)).speed_error == 0.30
