"""Laws checked on many generated cases (hypothesis): unit parsing round-trips, the ledger's monotonicity, and the
feasible Pareto front (no member dominated, every feasible non-member dominated by a member)."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimizer.ledger.core import Category, Location, Phase, evaluate
from optimizer.ledger.items import TRANSIENT_PHASES
from optimizer.results.pareto import feasible_front
from optimizer.study.knobs import Candidate, OffloadDevice, Precision, ZeroStage, parse_checkpointing
from optimizer.study.study_file import load_study
from optimizer.study.units import format_bytes, format_size, parse_size

MODEL_STATES = (Category.PARAMS, Category.GRADS, Category.OPTIMIZER, Category.MASTER_WEIGHTS)


@given(st.integers(min_value=0, max_value=2**50))
def test_a_printed_size_parses_back_within_its_rounding(num_bytes):
    # Decimal prints only: a hundredth of a KiB/MiB is not a whole number of bytes, which parse_size refuses
    # ('1.01 KiB' — a size is whole bytes), so binary prints are for reading, not for pasting back.
    for text in (format_size(num_bytes), format_bytes(num_bytes, binary=False, other=False)):
        back = parse_size(text)
        # two decimals of the unit printed: at most half a hundredth of it off, whole bytes exact
        unit = 1 if text.endswith(" B") else back / max(float(text.split()[0]), 1e-9)
        assert abs(back - num_bytes) <= 0.005 * unit + 1, (num_bytes, text, back)


@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(["B", "kB", "MB", "GB", "KiB", "MiB", "GiB"]))
def test_a_whole_number_of_a_unit_is_exact(count, unit):
    scale = {"B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    assert parse_size(f"{count} {unit}") == count * scale


@pytest.fixture(scope="module")
def studies(repo_root_module):
    """Three models on 4 and 8 ranks per node. (On 2 ranks ZeRO-1 can hold more model state than ZeRO-0: after
    backward the full gradients and the partition they reduce into coexist, 4Ψ + 4Σ beside 4Ψ + 12P ≥ ZeRO-0's
    16Ψ once 12P + 4Σ > 8Ψ — cpu-tiny: 1,969,664 B against 1,929,216; docs/ledger.md.)"""
    loaded = [load_study(repo_root_module / "studies" / name) for name in
              ("cpu-tiny.yaml", "llama-7b-8xh100.yaml", "llama-tiny-cpu.yaml")]
    return [replace(study, hardware=replace(study.hardware, gpus_per_node=n), training=replace(
        study.training, global_batch_size=64)) for study in loaded for n in (4, 8)]


@pytest.fixture(scope="module")
def repo_root_module():
    from pathlib import Path

    return Path(__file__).resolve().parents[3]


CANDIDATES = st.builds(
    Candidate,
    zero_stage=st.sampled_from(list(ZeroStage)),
    offload_optimizer=st.sampled_from([OffloadDevice.NONE, OffloadDevice.CPU]),
    offload_param=st.sampled_from([OffloadDevice.NONE, OffloadDevice.CPU]),
    precision=st.sampled_from([Precision.FP32, Precision.BF16]),
    checkpointing=st.sampled_from(["none", "full", "every_2"]).map(parse_checkpointing),
    micro_batch_size=st.sampled_from([1, 2, 4]),
)


def _ledger(study, candidate):
    return evaluate(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training).ledger


def _states(ledger) -> int:
    """The model states' own peak on the device: the always-live ones + the most any training phase adds."""
    def held(phase) -> int:
        return sum(i.bytes for i in ledger.items if i.category in MODEL_STATES and i.phase is phase
                   and i.location is Location.GPU)

    return held(Phase.ALWAYS) + max(held(phase) for phase in TRANSIENT_PHASES)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), candidate=CANDIDATES)
def test_more_micro_batch_never_needs_less_memory(studies, data, candidate):
    study = data.draw(st.sampled_from(studies))
    small, large = _ledger(study, candidate), _ledger(study, replace(candidate, micro_batch_size=2 * candidate
                                                                       .micro_batch_size))
    if small is not None and large is not None:
        assert large.training_needed_bytes >= small.training_needed_bytes


@settings(max_examples=150, deadline=None)
@given(data=st.data(), candidate=CANDIDATES)
def test_offloading_never_needs_more_device_memory(studies, data, candidate):
    study = data.draw(st.sampled_from(studies))
    kept = replace(candidate, offload_optimizer=OffloadDevice.NONE, offload_param=OffloadDevice.NONE)
    resident, offloaded = _ledger(study, kept), _ledger(study, candidate)
    if resident is not None and offloaded is not None and not offloaded.device_is_host:
        assert offloaded.training_needed_bytes <= resident.training_needed_bytes


@settings(max_examples=150, deadline=None)
@given(data=st.data(), candidate=CANDIDATES)
def test_a_higher_zero_stage_never_keeps_more_model_state_per_device(studies, data, candidate):
    study = data.draw(st.sampled_from(studies))
    plain = replace(candidate, offload_optimizer=OffloadDevice.NONE, offload_param=OffloadDevice.NONE)
    stages = list(ZeroStage)
    lower = data.draw(st.sampled_from(stages[:-1]))
    higher = stages[stages.index(lower) + 1]
    low, high = _ledger(study, replace(plain, zero_stage=lower)), _ledger(study, replace(plain, zero_stage=higher))
    if low is not None and high is not None:  # model states live at each one's training peak
        assert _states(high) <= _states(low)


POINTS = st.lists(st.tuples(st.integers(1, 20), st.integers(1, 20), st.booleans()), min_size=1, max_size=25)


@settings(max_examples=100, deadline=None)
@given(points=POINTS)
def test_the_front_is_exactly_the_undominated_feasible_trials(points):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["minimize", "maximize"])
    for number, (memory, speed, feasible) in enumerate(points):
        trial = optuna.trial.create_trial(values=[memory, speed], user_attrs={"label": f"c{number}"},
                                          system_attrs={"constraints": [-1.0 if feasible else 1.0]})
        study.add_trial(trial)
    front = feasible_front(study)
    ok = [(m, s) for m, s, f in points if f]

    def dominates(a, b):
        return a[0] <= b[0] and a[1] >= b[1] and a != b

    members = [tuple(t.values) for t in front]
    assert all(not any(dominates(o, m) for o in ok) for m in members)
    assert all(p in members or any(dominates(m, p) for m in members) for p in ok)
