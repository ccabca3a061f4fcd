"""Small rules of the search policy and the ledger, each checked against a figure worked by hand.

Covered: optimizer/search/launch_value.py (expected improvement, the front's summary, the time model's error),
optimizer/search/next_launch.py (the error a measured time class is priced with), optimizer/search/untried.py,
optimizer/search/ordering.py (an OOM that measured nothing), optimizer/search/coordination.py,
optimizer/search/device_attrs.py, and in optimizer/ledger/: activations.py (traced joint lines, why the formula
was used, where the lines came from), core.py (the init total), init_phase.py (a tied model's extra head, the
NVMe-offloaded master partition) and seed.py (names and sources of the seed's items).

Figures: the log-normal expected improvement E[max(0, T − T*)] = μ·e^{s²/2}·Φ(d₁) − T*·Φ(d₁ − s),
d₁ = (ln(μ/T*) + s²)/s (launch_value's module doc; Φ from a standard normal table), cpu-tiny's documented shape
(studies/cpu-tiny.yaml: 2 CPU ranks, global batch 8, sequence 64, 2 GiB per rank) and the formulas stated in
each module's docstring.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import yaml

from optimizer.ledger.activations import KORTHIKANTI, activation_items, activation_source
from optimizer.ledger.core import Ledger, evaluate
from optimizer.ledger.init_phase import construction_moments, init_moments
from optimizer.ledger.items import Category, LedgerItem, Location, Phase
from optimizer.ledger.seed import seed_items
from optimizer.perf.throughput import FEATURES, Rates
from optimizer.search.coordination import CLAIM_ATTR, running_elsewhere
from optimizer.search.device_attrs import CAPACITY_ATTR, record_result_json
from optimizer.search.launch_value import expected_improvement, front_summary, speed_error
from optimizer.search.next_launch import options
from optimizer.search.ordering import StudyModels, memory_group, study_models
from optimizer.search.space import branches
from optimizer.search.untried import untried_options
from optimizer.study.knobs import Candidate, OffloadDevice, Precision, ZeroStage, parse_checkpointing, with_knobs
from optimizer.study.specs import ActivationSource, Construction, baseline_candidate
from optimizer.study.study_file import load_study
from optimizer.study.traced_activation import TracedActivation

ROOT = Path(__file__).resolve().parents[3]
TrialState = optuna.trial.TrialState


def _candidate(stage: int, precision: str, *, mbs: int = 1, ckpt: str = "none", opt: str = "none",
               param: str = "none") -> Candidate:
    return Candidate(zero_stage=ZeroStage(stage), precision=Precision(precision), micro_batch_size=mbs,
                     checkpointing=parse_checkpointing(ckpt), offload_optimizer=OffloadDevice(opt),
                     offload_param=OffloadDevice(param))


@pytest.fixture(scope="module")
def tiny():
    return load_study(ROOT / "studies" / "cpu-tiny.yaml")


# --- launch_value.py ---------------------------------------------------------------------------------------

def test_expected_improvement_at_the_best_speed_with_half_a_log_unit_of_error():
    # μ = T* = 100, s = 0.5: d₁ = (ln 1 + 0.25)/0.5 = 0.5; e^{0.125} = 1.1331485, Φ(0.5) = 0.6914625, Φ(0) = 0.5
    # EI = 100·1.1331485·0.6914625 − 100·0.5 = 78.35296 − 50 = 28.35296 (a spread below one log unit still counts)
    assert expected_improvement(median=100.0, sigma=0.5, best=100.0) == pytest.approx(28.35296, abs=1e-4)


def _done(values, *, attrs=None, system=None, state=TrialState.COMPLETE):
    return optuna.trial.create_trial(state=state, values=values, user_attrs=attrs or {}, system_attrs=system or {})


def test_front_summary_leaves_out_an_infeasible_point_and_subtracts_the_steps_from_the_wall_time():
    ok = _done([500.0, 1000.0], attrs={"wall_s": 100.0, "step_time_s": 2.0})
    # complete and fast, but its loss fidelity constraint is violated (> 0): not on the feasible front
    bad = _done([400.0, 9000.0], system={"constraints:loss_fidelity": 0.5})
    front = front_summary([ok, bad], speed_error=0.2, steps_per_launch=10)
    assert front.best_tokens_per_s == 1000.0 and front.leanest_bytes == 500
    assert front.overhead_s == 80.0  # 100 s of wall time − 10 steps × 2 s; one measured trial: its mean
    assert front.speed_error == 0.2


def test_speed_error_is_the_rms_of_the_log_ratio_of_predicted_to_measured():
    # one pair, predicted 3 s for a measured 1.5 s: ln(3/1.5) = ln 2 = 0.693147 (above the 0.15 floor)
    assert speed_error([(3.0, 1.5)], calibrated=True) == pytest.approx(0.693147, abs=1e-6)


# --- next_launch.py: a measured time class is priced with the calibrated error --------------------------------

def test_a_measured_time_class_gets_the_calibrated_error_and_an_unmeasured_one_the_larger():
    """Rates: only a micro-step costs time, 0.1 s at stages 0 and 1. cpu-tiny: global batch 8 on 2 ranks, so
    8/(2·b) micro-steps per step and 8·64 = 512 tokens per step; mbs 1 → 0.4 s, mbs 2 → 0.2 s, mbs 4 → 0.1 s,
    i.e. 5,120 tokens/s at mbs 4. Two z0 fp32 trials measured as predicted (0.4 s and 0.2 s): z0 fp32 is a
    measured class, the model's error is ln 1 = 0, held at the 0.15 floor; T* = 2,560 tokens/s (mbs 2).
    Each launch: no measured overhead, 2 warm-up + 3 measured steps of 0.1 s, P = 1 (a few MB of 2 GiB): 0.5 s.
    z0 fp32 mbs 4, s = 0.15: d₁ = (ln 2 + 0.0225)/0.15 = 4.77098, Φ(d₁) = 0.9999991, Φ(d₁ − s) = 0.9999981,
    EI = 5120·e^{0.01125}·0.9999991 − 2560·0.9999981 = 5177.920 − 2559.995 = 2617.925;
    value = (2617.925/2560)/0.5 = 2.04525.
    z1 fp32 mbs 4 (no z1 trial), s = ln 2 = 0.693147: d₁ = (0.693147 + 0.480453)/0.693147 = 1.693147,
    Φ(d₁) = 0.9547863, Φ(d₁ − s) = Φ(1) = 0.8413447, EI = 5120·1.2715371·0.9547863 − 2560·0.8413447 = 4062.074;
    value = (4062.074/2560)/0.5 = 3.17350."""
    spec = load_study(ROOT / "studies" / "cpu-tiny.yaml")
    known = {name: 0.0 for name in FEATURES} | {"micro_steps_z0": 0.1, "micro_steps_z1": 0.1}
    models = StudyModels(rates=Rates(seconds_per=tuple(known[n] for n in FEATURES), source="test"),
                         memory_factors=(), time_samples=2, measured_fits=frozenset())
    trials = [_done([1.0, 512.0 / step], attrs={"candidate": _candidate(0, "fp32", mbs=mbs).knobs(),
                                                 "label": _candidate(0, "fp32", mbs=mbs).label(),
                                                 "loss_fidelity": 0.0, "step_time_s": step})
              for mbs, step in ((1, 0.4), (2, 0.2))]
    verdicts = [evaluate(candidate=c, model=spec.model, hardware=spec.hardware, training=spec.training)
                for c in (_candidate(0, "fp32", mbs=4), _candidate(1, "fp32", mbs=4))]
    ranked = options(spec=spec, space=branches(spec), trials=trials, models=models, verdicts=verdicts)
    values = {o.candidate.label(): o.value for o in ranked}
    assert values == pytest.approx({"z0 fp32 ckpt=none mbs=4": 2.04525, "z1 fp32 ckpt=none mbs=4": 3.17350},
                                   abs=1e-4)
    assert [o.candidate.label() for o in ranked] == ["z1 fp32 ckpt=none mbs=4", "z0 fp32 ckpt=none mbs=4"]


# --- untried.py ----------------------------------------------------------------------------------------------

def _small_study(folder: Path, knobs: dict):
    raw = yaml.safe_load((ROOT / "studies" / "cpu-tiny.yaml").read_text())
    raw["search_space"] = {"knobs": knobs}
    path = folder / "cpu-tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_study(path)


def test_untried_options_lists_the_space_in_promise_order_less_what_was_measured(tmp_path):
    # cpu-tiny's 2-layer GPT needs a few MB of its 2 GiB: all four candidates may fit. CPU ranks have no
    # hardware profile, so nothing is predicted and the order is next_launch.promise's: lower stage first,
    # 16-bit before fp32.
    spec = _small_study(tmp_path, {"zero_stage": [0, 1], "precision": ["fp32", "bf16"], "micro_batch_size": [1]})
    labels = ["z0 bf16 ckpt=none mbs=1", "z0 fp32 ckpt=none mbs=1", "z1 bf16 ckpt=none mbs=1",
              "z1 fp32 ckpt=none mbs=1"]
    assert [o.candidate.label() for o in untried_options(spec, [])] == labels
    measured = _done([1.0, 1.0], attrs={"label": "z0 fp32 ckpt=none mbs=1", "loss_fidelity": 0.0})
    queued = optuna.trial.create_trial(state=TrialState.WAITING, params={}, distributions={},
                                       user_attrs={"label": "z1 bf16 ckpt=none mbs=1"})
    # measured: gone; queued: still untried (a stop leaves it so)
    assert [o.candidate.label() for o in untried_options(spec, [measured, queued])] == [
        labels[0], labels[2], labels[3]]


# --- ordering.py ---------------------------------------------------------------------------------------------

def test_an_oom_that_measured_nothing_counts_as_just_over_the_budget(tiny):
    spec = tiny
    base = baseline_candidate(spec.training)
    candidate = _candidate(0, "fp32", mbs=2)
    oom = optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={
        "candidate": candidate.knobs(), "label": candidate.label(), "outcome": "oom",
        "predicted_gpu_needed_bytes": 2**30})
    models = study_models(spec=spec, trials=[oom], base=base)
    # one sample: measured = budget + 1 = 2 GiB + 1 against 1 GiB predicted, k = (2^31 + 1)/2^30
    assert dict(models.memory_factors) == {memory_group(candidate): (2**31 + 1) / 2**30}
    assert models.measured_fits == frozenset()


# --- coordination.py / device_attrs.py -----------------------------------------------------------------------

def _claimed(number: int, key: str, state=TrialState.RUNNING):
    trial = optuna.trial.create_trial(state=state, values=[1.0, 1.0] if state is TrialState.COMPLETE else None,
                                      user_attrs={CLAIM_ATTR: {"trial": number, "key": key, "state": "claimed"}})
    trial.number = number
    return trial


def test_running_elsewhere_sees_another_running_claim_and_not_its_own():
    trials = [_claimed(3, "z1 bf16 ckpt=none mbs=1"), _claimed(4, "z2 bf16 ckpt=none mbs=1", TrialState.COMPLETE)]
    assert running_elsewhere(trials, "z1 bf16 ckpt=none mbs=1", exclude=7) is True
    assert running_elsewhere(trials, "z1 bf16 ckpt=none mbs=1", exclude=3) is False  # its own claim
    assert running_elsewhere(trials, "z2 bf16 ckpt=none mbs=1", exclude=7) is False  # finished, not running


def test_a_result_json_without_ranks_still_records_the_device_capacity():
    study = optuna.create_study(directions=["minimize", "maximize"])
    record_result_json(study, {"outcome": "invalid", "device_total_bytes": 80_000_000_000})
    assert study.user_attrs[CAPACITY_ATTR] == 80_000_000_000


# --- ledger/activations.py -----------------------------------------------------------------------------------

def test_joined_trace_gives_the_activations_and_gradients_at_their_joint_peak(tiny):
    traced = TracedActivation(checkpointing="none", precision=Precision.BF16, points=((2, 1000),),
                              joint_points=((2, 700, 300),))
    model = replace(tiny.model, activations=ActivationSource.TRACE, traced_activations=(traced,))
    items = activation_items(model=model, candidate=_candidate(0, "bf16", mbs=2), sequence_length=64,
                             element_bytes=2, joined=True)
    # traced at b = 2: 700 bytes of activations + 300 of gradients at the joint peak, not the 1000-byte mark
    assert [(i.category, i.bytes, i.phase) for i in items] == [
        (Category.ACTIVATIONS, 700, Phase.BACKWARD), (Category.GRADS, 300, Phase.BACKWARD)]
    assert items[0].formula == "traced at b = 2"


@pytest.mark.parametrize(("source", "why"), [(ActivationSource.AUTO, "not traced"),
                                             (ActivationSource.TRACE, "no trace for this granularity")])
def test_the_formula_says_why_no_trace_was_used(tiny, source, why):
    model = replace(tiny.model, activations=source, traced_activations=())
    items = activation_items(model=model, candidate=_candidate(0, "bf16"), sequence_length=64, element_bytes=2)
    assert items and {i.source for i in items} == {f"formula ({why}): {KORTHIKANTI}"}


def _line(category: Category, source: str) -> LedgerItem:
    return LedgerItem(name="x", category=category, location=Location.GPU, bytes=1, formula="1", source=source)


def test_activation_source_names_the_activation_lines_part_before_the_colon():
    items = [_line(Category.ACTIVATIONS, "trace: the study's model on fake tensors (bf16)"),
             _line(Category.ACTIVATIONS, "formula: Korthikanti"), _line(Category.PARAMS, "ZeRO: the paper")]
    assert activation_source(items) == "formula + trace"
    assert activation_source([_line(Category.PARAMS, "ZeRO: the paper")]) == "none"


# --- ledger/core.py ------------------------------------------------------------------------------------------

def test_phase_totals_init_counts_the_device_items_of_init_alone():
    def item(num_bytes, location, phase):
        return LedgerItem(name="x", category=Category.PARAMS, location=location, bytes=num_bytes, formula="",
                          source="", phase=phase)

    ledger = Ledger(candidate=_candidate(0, "fp32"), ranks_per_node=1, device_is_host=False,
                    gpu_capacity_bytes=10_000, device_reserve_bytes=0, allocator_overhead=0.0,
                    host_capacity_bytes=None, nvme_capacity_bytes=None,
                    items=(item(100, Location.GPU, Phase.ALWAYS), item(40, Location.GPU, Phase.BACKWARD),
                           item(700, Location.GPU, Phase.INIT), item(5000, Location.HOST, Phase.INIT)))
    totals = ledger.phase_totals()
    assert totals["init"] == 700  # the host's 5000 init bytes are not on the device
    assert totals["backward"] == 140  # 100 always + 40


# --- ledger/init_phase.py ------------------------------------------------------------------------------------

def test_a_tied_model_built_on_the_device_holds_its_own_head_until_tied():
    moments = construction_moments(construction=Construction.DEVICE, precision=Precision.BF16, g=2, psi=1000,
                                   q=500, largest_module=20, param_place=Location.GPU, tied=300)
    assert len(moments) == 1
    head = moments[0][1]
    # T = 300 tied elements in bf16: 2·300 = 600 bytes on the device, in the init phase
    assert (head.name, head.bytes, head.formula, head.location, head.phase, head.category) == (
        "tied weight's own copy until it is tied", 600, "2·T", Location.GPU, Phase.INIT, Category.PARAMS)


def test_zero3_with_the_optimizer_on_nvme_holds_one_fp32_sub_group_of_master_weights():
    candidate = _candidate(3, "bf16", opt="nvme")
    moments = init_moments(candidate=candidate, construction=Construction.ZERO_INIT, psi=1000, padded=1000,
                           p=500, q=500, s=100, largest_tensor=10, largest_module=20, bucket=50, device_bytes=None)
    masters = [i for m in moments for i in m if i.category is Category.MASTER_WEIGHTS]
    # NVMe optimizer: only the sub-group S = 100 elements is in memory, 4·100 = 400 bytes (not 4Q = 2000)
    assert masters and {(i.bytes, i.formula) for i in masters} == {(400, "4S")}


# --- ledger/seed.py ------------------------------------------------------------------------------------------

def test_seed_items_name_their_precision_and_their_source(seed_study_path):
    study = load_study(seed_study_path)
    fp32 = seed_items(candidate=baseline_candidate(study.training), model=study.model, hardware=study.hardware,
                      training=study.training)
    params = next(i for i in fp32 if i.category is Category.PARAMS)
    assert params.name == "fp32 parameters"
    assert params.source.startswith("seed document (Q130)")  # fp32: the seed's own table
    bf16 = seed_items(candidate=with_knobs(baseline_candidate(study.training), {"precision": "bf16"}),
                      model=study.model, hardware=study.hardware, training=study.training)
    master = next(i for i in bf16 if i.category is Category.MASTER_WEIGHTS)
    assert master.source.startswith("ZeRO (Rajbhandari et al. 2020) §3")  # mixed precision: the ZeRO paper
    assert next(i for i in bf16 if i.category is Category.PARAMS).source.startswith("ZeRO (Rajbhandari")
