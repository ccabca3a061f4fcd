"""ZeRO stage 0 when autograd's gradients join the traced activations, integer partition sizes, and a tied model's
extra head at construction (optimizer/ledger/model_states.py: ``_stage0``, ``_sizes``, ``construction_bytes``),
worked by hand.

The model is grid-cpu's GPT (Ψ = 120,576 on N = 2 ranks, counted by hand in
tests/optimizer/ledger/test_zero12_phases.py; the
largest tensor Lₜ = 64·256 = 16,384 elements), on CUDA ranks so that no gloo item enters. Figures: 2Ψ = 241,152,
4Ψ = 482,304, 8Ψ = 964,608; ZeRO-1's partition P = Ψ/N = 60,288 (Ψ is a multiple of 2N: no padding,
stage_1_and_2.py:387,441), 4P = 241,152, 8P = 482,304. The allreduce flatten is g·min(Ψ, 5e8 + Lₜ) = g·Ψ here
(engine.py:151 MEMORY_OPT_ALLREDUCE_SIZE = 5e8; engine.py:3073-3095).

With one micro-batch a step and a trace that carries the joint of activations and gradients, stage 0's full
gradients are counted after backward only: in the reduce phase (allreduce) and the step (the optimizer reads
them), not always — DeepSpeed 0.19.8's engine.py:3495-3500 sets every ``.grad`` to None after the step, and during
backward the trace's joint line holds the gradients made so far.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from optimizer.ledger.core import compute_ledger
from optimizer.ledger.items import Category, Location, Phase
from optimizer.ledger.model_states import construction_bytes
from optimizer.study.inventory import InventoryTensor, ParameterInventory
from optimizer.study.knobs import Precision, with_knobs
from optimizer.study.specs import ActivationSource, baseline_candidate
from optimizer.study.study_file import load_study
from optimizer.study.traced_activation import TracedActivation

ROOT = Path(__file__).resolve().parents[3]
DS = "DeepSpeed 0.19.8"
ENGINE = f"{DS} engine.py"
AUTOGRAD = f"{DS} engine.py (autograd)"
FLATTEN = "allreduce flatten (≤ 5e8 + Lₜ elements)"
FLATTEN_SOURCE = f"{DS} engine.py:3073-3095 (MEMORY_OPT_ALLREDUCE_SIZE)"
ADAM = "Adam exp_avg + exp_avg_sq (fp32)"
ADAM_SOURCE = "ZeRO paper §3; fused_adam.py:153-157"


@pytest.fixture(scope="module")
def study():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    gpu = dataclasses.replace(study.hardware, accelerator="cuda",
                              supported_precisions=(Precision.FP32, Precision.BF16, Precision.FP16))
    # global batch 4 = 2 ranks × micro-batch 2: one micro-batch a step, so the joint applies
    training = dataclasses.replace(study.training, global_batch_size=4)
    return dataclasses.replace(study, hardware=gpu, training=training)


def _traced(study, precision: Precision, *, joint: bool):
    entry = TracedActivation(checkpointing="none", precision=precision, points=((2, 500_000),),
                             joint_points=((2, 400_000, 100_000),) if joint else ())
    return dataclasses.replace(study.model, activations=ActivationSource.TRACE, traced_activations=(entry,))


def _model_states(study, precision: str, *, joint: bool = True) -> list[tuple]:
    """The training-time model-state items (not the init phase, not the traced activation/joint lines)."""
    candidate = with_knobs(baseline_candidate(study.training), {"zero_stage": 0, "precision": precision,
                                                                "micro_batch_size": 2})
    ledger = compute_ledger(candidate=candidate, model=_traced(study, Precision(precision), joint=joint),
                            hardware=study.hardware, training=study.training)
    return [(i.name, i.category, i.location, i.bytes, i.formula, i.source, i.phase) for i in ledger.items
            if i.phase is not Phase.INIT and i.category is not Category.ACTIVATIONS
            and not i.source.startswith("trace")]


def test_joined_bf16_gradients_are_counted_in_reduce_and_step_only(study):
    assert _model_states(study, "bf16") == [
        ("bf16 parameters", Category.PARAMS, Location.GPU, 241_152, "2Ψ", ENGINE, Phase.ALWAYS),  # 2 × 120,576
        ("bf16 gradients", Category.GRADS, Location.GPU, 241_152, "2Ψ", AUTOGRAD, Phase.REDUCE),
        ("bf16 gradients", Category.GRADS, Location.GPU, 241_152, "2Ψ", AUTOGRAD, Phase.STEP),
        (ADAM, Category.OPTIMIZER, Location.GPU, 964_608, "8Ψ", ADAM_SOURCE, Phase.ALWAYS),  # 8 × 120,576
        # 2·min(120,576, 500,016,384) = 241,152
        (FLATTEN, Category.BUFFERS, Location.GPU, 241_152, "2·min(Ψ, 5e8 + Lₜ)", FLATTEN_SOURCE, Phase.REDUCE),
        # FP16_Optimizer's flat fp32 master (fused_optimizer.py:100), 4Ψ; in the step its fp32 gradient list and
        # their flat copy (fused_optimizer.py:285-288), 8Ψ
        ("fp32 master weights (flat)", Category.MASTER_WEIGHTS, Location.GPU, 482_304, "4Ψ",
         f"{DS} runtime/fp16/fused_optimizer.py:100", Phase.ALWAYS),
        ("fp32 gradient list + flat copy in step", Category.GRADS, Location.GPU, 964_608, "8Ψ",
         f"{DS} runtime/fp16/fused_optimizer.py:285-288", Phase.STEP),
    ]


def test_joined_fp32_gradients_are_counted_in_reduce_and_step_only(study):
    # fp32: FusedAdam on the parameters themselves, no master copy; 4Ψ = 482,304
    assert _model_states(study, "fp32") == [
        ("fp32 parameters", Category.PARAMS, Location.GPU, 482_304, "4Ψ", ENGINE, Phase.ALWAYS),
        ("fp32 gradients", Category.GRADS, Location.GPU, 482_304, "4Ψ", AUTOGRAD, Phase.REDUCE),
        ("fp32 gradients", Category.GRADS, Location.GPU, 482_304, "4Ψ", AUTOGRAD, Phase.STEP),
        (ADAM, Category.OPTIMIZER, Location.GPU, 964_608, "8Ψ", ADAM_SOURCE, Phase.ALWAYS),
        (FLATTEN, Category.BUFFERS, Location.GPU, 482_304, "4·min(Ψ, 5e8 + Lₜ)", FLATTEN_SOURCE, Phase.REDUCE),
    ]


def test_without_a_joint_trace_the_gradients_are_always_there(study):
    # the same trace without joint points: no joined line, so the full gradients are held through backward too
    grads = [row for row in _model_states(study, "bf16", joint=False) if row[0] == "bf16 gradients"]
    assert grads == [("bf16 gradients", Category.GRADS, Location.GPU, 241_152, "2Ψ", AUTOGRAD, Phase.ALWAYS)]


def test_zero1_partition_items_are_whole_bytes(study):
    # P = 120,576 / 2 = 60,288 elements: the fp32 master 4P = 241,152 and Adam 8P = 482,304 bytes, as integers
    # (LedgerItem.bytes is an int; STYLE: bytes are integers), in training and in the init phase alike
    candidate = with_knobs(baseline_candidate(study.training), {"zero_stage": 1, "precision": "bf16",
                                                                "micro_batch_size": 2})
    ledger = compute_ledger(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)
    found = [(i.name, i.bytes, i.phase) for i in ledger.items if i.formula in ("4P", "8P")]
    assert found == [("fp32 master partition", 241_152, Phase.ALWAYS), (ADAM, 482_304, Phase.ALWAYS),
                     ("fp32 master partition", 241_152, Phase.INIT),
                     ("zero fp32 gradient partition", 241_152, Phase.INIT)]
    assert [type(i.bytes) for i in ledger.items if i.formula in ("4P", "8P")] == [int] * 4
    assert all(type(i.bytes) is int for i in ledger.items)


# A hand-made inventory with a tied head: the embedding (256 × 64 = 16,384 elements) shared by lm_head, one Linear
# (256 × 64 = 16,384) and a norm (64): Ψ = 32,832, T = 16,384 (the head transformers builds with its own weight
# before tie_weights points it at the embedding, modeling_utils.py:2624 in 5.24).
TIED = ParameterInventory(
    tensors=(InventoryTensor(name="wte.weight", module="wte", module_type="Embedding", shape=(256, 64),
                             dtype="float32"),
             InventoryTensor(name="h.0.fc.weight", module="h.0.fc", module_type="Linear", shape=(256, 64),
                             dtype="float32"),
             InventoryTensor(name="ln_f.weight", module="ln_f", module_type="LayerNorm", shape=(64,),
                             dtype="float32")),
    tied=(("wte.weight", "lm_head.weight"),), model_class="M", source="hand-made for tests")


def test_a_tied_model_built_on_the_device_holds_its_head_twice_at_construction(study):
    model = dataclasses.replace(study.model, inventory=TIED)
    candidate = with_knobs(baseline_candidate(study.training), {"zero_stage": 0, "precision": "bf16",
                                                                "micro_batch_size": 2})
    # model_init auto at stage 0 builds on the device in bf16: 2Ψ + 2T = 65,664 + 32,768 = 98,432 bytes
    assert construction_bytes(candidate=candidate, model=model, hardware=study.hardware,
                              training=study.training) == 98_432


def test_a_tied_model_built_whole_on_the_host_lists_the_heads_own_copy(study):
    model = dataclasses.replace(study.model, inventory=TIED)
    training = dataclasses.replace(study.training, model_init="full")
    candidate = with_knobs(baseline_candidate(training), {"zero_stage": 0, "precision": "bf16",
                                                          "micro_batch_size": 2})
    ledger = compute_ledger(candidate=candidate, model=model, hardware=study.hardware, training=training)
    host = [(i.name, i.bytes, i.formula) for i in ledger.items if i.phase is Phase.INIT and i.location is Location.HOST]
    # built in fp32 on the host: 4Ψ = 131,328 and the head's own copy 4T = 65,536, more than the cast's
    # 4Ψ + 2Lₜ = 131,328 + 32,768 (engine.py:1859-1862), so the construction is the host's init peak
    assert host == [("model built in fp32 on the host", 131_328, "4Ψ"),
                    ("tied weight's own copy until it is tied", 65_536, "4·T")]
