"""ZeRO-3's gathered parameters and the activations taken at one traced moment (optimizer/ledger/zero3_states.py,
optimizer/ledger/activations.py): where the trace carries the pair whose sum peaked
(:attr:`TracedActivation.zero3_joint_points`), the ledger books that pair — not the most ever gathered beside the
activations' high-water mark — and only where ZeRO-3 gathers into new memory (one rank with the partition on the
device gathers views). The trace's figures are stated, not traced: the rule is under test here; the replay and
the trace are checked in tests/optimizer/deepspeed/test_zero3_gather.py and tests/launchers/trace/.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from optimizer.deepspeed.zero_settings import zero_settings
from optimizer.ledger.core import compute_ledger
from optimizer.ledger.items import Category, Location, Phase
from optimizer.ledger.state_sizes import _sizes
from optimizer.study.knobs import Precision, ZeroStage, with_knobs
from optimizer.study.specs import ActivationSource, baseline_candidate
from optimizer.study.study_file import load_study
from optimizer.study.traced_activation import TracedActivation

ROOT = Path(__file__).resolve().parents[3]
PEAK = {2: 900_000, 4: 1_700_000}  # stated: the activations' high-water mark per micro-batch
MOST = 30_000  # the most elements ever gathered at once (fp32: 120,000 bytes)
JOINT = {2: (850_000, 40_000), 4: (1_600_000, 48_000)}  # (activations, gathered bytes) where their sum peaked
KEPT = "released 4-bit weights bitsandbytes' matmul still holds (this micro-step's and, while the loop keeps its " \
    "last loss, the previous one's)"


def _study(*, joint: bool = True, gpus: int = 2, copies: dict[int, int] | None = None, held: int = 0,
           gathered: dict[int, int] | None = None, reference: dict[int, int] | None = None):
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    points = tuple((b, w, (gathered or {}).get(b, g), (copies or {}).get(b, 0), (reference or {}).get(b, 0))
                   for b, (w, g) in JOINT.items())
    entry = TracedActivation(checkpointing="full", precision=Precision.FP32, points=tuple(PEAK.items()),
                             zero3_gathered=MOST, zero3_autograd_held=held,
                             zero3_joint_points=points if joint else ())
    model = dataclasses.replace(study.model, activations=ActivationSource.TRACE, traced_activations=(entry,),
                                reference_model=reference is not None)
    hardware = dataclasses.replace(study.hardware, gpus_per_node=gpus)
    training = dataclasses.replace(study.training, global_batch_size=4 * gpus)
    return dataclasses.replace(study, model=model, hardware=hardware, training=training)


def _lines(study, micro_batch: int) -> dict[str, int]:
    candidate = with_knobs(baseline_candidate(study.training), {"zero_stage": 3, "checkpointing": "full",
                                                                 "micro_batch_size": micro_batch})
    ledger = compute_ledger(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)
    return {i.name: i.bytes for i in ledger.items if i.location is Location.GPU and i.phase is Phase.BACKWARD
            and (i.category is Category.ACTIVATIONS or "gathered" in i.name or "4-bit" in i.name)}


@pytest.mark.parametrize("micro_batch", [2, 4])
def test_the_gathered_parameters_and_the_activations_are_booked_at_the_moment_their_sum_peaked(micro_batch):
    activations, gathered = JOINT[micro_batch]
    assert _lines(_study(), micro_batch) == {
        "parameters gathered where they and the activations together peak (the coordinator replayed over the "
        "traced step)": gathered,
        "activations where they and ZeRO-3's gathered parameters peak (full)": activations}


def test_between_traced_micro_batches_the_pair_is_joined_as_the_activations_are():
    entry = _study().model.traced_activations[0]
    assert entry.zero3_joint_at(3) == (1_225_000, 44_000, 0, 0)
    assert entry.zero3_joint_at(2) == (*JOINT[2], 0, 0)


def test_the_4_bit_weights_autograd_keeps_are_a_line_of_their_own_and_what_max_live_releases_stays():
    # at the joint moment 7,000 bytes of released 4-bit copies (optimizer/deepspeed/zero3_gather.autograd_copies)
    lines = _lines(_study(copies={2: 7_000, 4: 9_000}, held=20_000), 2)
    assert lines[KEPT] == 7_000 and lines[
        "parameters gathered where they and the activations together peak (the coordinator replayed over the "
        "traced step)"] == JOINT[2][1]
    # a traced depth held more than the coordinator's max_live lets it: what it releases of the 4-bit weights
    # autograd keeps, up to all of them (20,000)
    huge = _lines(_study(copies={2: 7_000, 4: 9_000}, held=20_000, gathered={2: 10**15, 4: 10**15}), 2)
    assert huge[KEPT] == 7_000 + 20_000
    assert KEPT not in _lines(_study(), 2)  # no 4-bit weight kept: no line
    assert KEPT not in _lines(_study(gpus=1, copies={2: 7_000, 4: 9_000}, held=20_000), 2)  # one rank: views


def test_without_the_pair_the_most_gathered_is_added_to_the_high_water_mark():
    assert _lines(_study(joint=False), 2) == {
        "parameters gathered at once (the coordinator replayed over the traced module order)": 4 * MOST,
        "activations, traced high-water mark (full, backward)": PEAK[2]}


def test_one_rank_gathers_views_so_the_high_water_mark_stands_alone():
    lines = _lines(_study(gpus=1), 2)
    assert lines == {"parameters gathered (one rank: views of the partition, no copy)": 0,
                     "activations, traced high-water mark (full, backward)": PEAK[2]}


REFERENCE = "reference model: parameters gathered or in flight where they, the policy's and the activations together " \
    "peak (its coordinator replayed over its traced forward)"
FORMULA = "reference model: parameters gathered or in flight for its forward (its prefetch front, up to max_live)"


def test_a_reference_copys_own_gathers_are_booked_at_the_same_moment_and_capped_by_its_max_live():
    # the copy's coordinator replayed over its traced forward (launchers/trace/zero3_held.reference_held): what it
    # holds at the moment everything together peaked, instead of one prefetch bucket and the largest module
    lines = _lines(_study(reference={2: 30_000, 4: 36_000}), 2)
    assert lines[REFERENCE] == 30_000 and FORMULA not in lines
    assert lines["activations where they and ZeRO-3's gathered parameters peak (full)"] == JOINT[2][0]
    study = _study(reference={2: 10**15, 4: 10**15})  # a traced depth over the copy's max_live
    candidate = with_knobs(baseline_candidate(study.training), {"zero_stage": 3, "checkpointing": "full",
                                                                 "micro_batch_size": 2})
    settings = zero_settings(model=study.model, stage=ZeroStage.PARAMETERS)
    z = _sizes(model=study.model, candidate=candidate, hardware=study.hardware, training=study.training,
               settings=settings)
    assert _lines(study, 2)[REFERENCE] == 4 * (settings.max_live_parameters + z.largest_module)
    # no reference part at the joint moment (a trace extended from shallow copies has none) or not traced: the
    # formula's line
    for lines in (_lines(_study(reference={2: 0, 4: 0}), 2), _lines(_study(joint=False, reference={}), 2)):
        assert FORMULA in lines and REFERENCE not in lines
