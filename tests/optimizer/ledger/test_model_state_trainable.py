"""Model-state items of a model that trains in part (issue 36), worked by hand: a hand-made inventory of a frozen
embedding, a frozen base weight, its LoRA A and B and a frozen norm — Ψ = 1,500, Ψtr = 80 — on 2 GPUs.

Read from DeepSpeed 0.19.8: the whole module is cast (``engine.py:1859-1862``); FP16_Optimizer, ZeRO-1/2's flat group
and ZeRO-3's optimizer hold the trainable tensors only (``runtime/utils.py:815-825``, ``fused_optimizer.py:91``,
``stage_1_and_2.py:428-434``, ``stage3.py:732-737``); ZeRO-3 partitions every parameter (``partition_parameters.py``
``_zero_init_param``, no ``requires_grad`` test)."""

from __future__ import annotations

import pytest

from optimizer.ledger.model_states import transformer_items
from optimizer.ledger.transformer import trainable_count, zero12_partition
from optimizer.study.inventory import InventoryTensor, ParameterInventory
from optimizer.study.knobs import Candidate, NoCheckpointing, OffloadDevice, Precision, ZeroStage
from optimizer.study.specs import ActivationSource, HardwareSpec, ModelInit, TrainingSpec, TransformerModel

TENSORS = [("embed_tokens.weight", "embed_tokens", (50, 20), False),
           ("layers.0.attn.q.base_layer.weight", "layers.0.attn.q.base_layer", (20, 20), False),
           ("layers.0.attn.q.lora_A.default.weight", "layers.0.attn.q.lora_A.default", (2, 20), True),
           ("layers.0.attn.q.lora_B.default.weight", "layers.0.attn.q.lora_B.default", (20, 2), True),
           ("final_norm.weight", "final_norm", (20,), False)]
INVENTORY = ParameterInventory(tensors=tuple(
    InventoryTensor(name=n, module=m, module_type="Linear", shape=s, dtype="float32", trainable=t, adapter=t)
    for n, m, s, t in TENSORS), model_class="PeftModel")
MODEL = TransformerModel(layers=1, hidden_size=20, heads=2, kv_heads=2, ffn_size=80, vocab_size=50,
                         max_positions=16, activations=ActivationSource.FORMULA, inventory=INVENTORY,
                         peft='{"peft_type":"LORA","r":2,"target_modules":["q"]}')
HARDWARE = HardwareSpec(gpus_per_node=2, gpu_memory_bytes=10**9)
TRAINING = TrainingSpec(global_batch_size=4, micro_batch_size=2, sequence_length=16)


def _items(stage: int, precision: Precision, training: TrainingSpec = TRAINING) -> dict[str, int]:
    candidate = Candidate(zero_stage=ZeroStage(stage), offload_optimizer=OffloadDevice.NONE,
                          offload_param=OffloadDevice.NONE, precision=precision, checkpointing=NoCheckpointing(),
                          micro_batch_size=2)
    items = transformer_items(candidate=candidate, model=MODEL, hardware=HARDWARE, training=training)
    return {i.name: i.bytes for i in items if i.phase.value != "init"}


def test_the_counts_by_hand():
    assert INVENTORY.parameters == 1000 + 400 + 40 + 40 + 20 and trainable_count(MODEL) == 80
    # the flat group is A then B: 80 elements, padded to 2N = 4 (80), P = 40; rank 0 owns A, rank 1 owns B
    assert zero12_partition(MODEL, ranks=2).held == 40


def test_zero0_casts_the_whole_model_and_keeps_state_for_the_adapters_alone():
    fp32 = _items(0, Precision.FP32)
    assert fp32["fp32 parameters"] == 4 * 1500
    assert fp32["fp32 gradients"] == 4 * 80 and fp32["Adam exp_avg + exp_avg_sq (fp32)"] == 8 * 80
    assert fp32["allreduce flatten (≤ 5e8 + Lₜ elements)"] == 4 * 80
    bf16 = _items(0, Precision.BF16)
    assert bf16["bf16 parameters"] == 2 * 1500 and bf16["fp32 master weights (flat)"] == 4 * 80
    assert bf16["fp32 gradient list + flat copy in step"] == 8 * 80


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_flattens_the_adapters_and_holds_the_frozen_weights_whole(stage):
    items = _items(stage, Precision.BF16)
    assert items["bf16 parameters (flat, full)"] == 2 * 80
    assert items["frozen bf16 parameters (whole on every rank)"] == 2 * 1420
    assert items["fp32 master partition"] == 4 * 40 and items["Adam exp_avg + exp_avg_sq (fp32)"] == 8 * 40


def test_zero3_partitions_every_parameter_and_keeps_state_for_the_adapters_alone():
    items = _items(3, Precision.FP32)
    # Q = 500 + 200 + 20 + 20 + 10 and Qtr = 20 + 20; the persistence threshold 10·h = 200 keeps A, B and the
    # norm whole on every rank (the 400-element base weight and the embedding are partitioned)
    assert items["fp32 parameter partition"] == 4 * 750
    assert items["fp32 gradient partition"] == 4 * 40
    assert items["fp32 master partition"] == 4 * 40 and items["Adam exp_avg + exp_avg_sq (fp32)"] == 8 * 40
    assert items["persistent parameters (≤ 200 elements each)"] == 4 * (40 + 40 + 20)


def test_zero3_in_bf16_keeps_peft_adapters_fp32_where_zero_init_built_the_model():
    """PEFT upcasts its adapters to fp32 (autocast_adapter_dtype) and the engine does not cast a model zero.Init built
    (engine.py:1859-1862): at ZeRO-3 in bf16 the adapters' partitions and their persistent copies are 4 bytes each
    (Qa = 20 + 20, Ka = 40 + 40; measured on 2 CPU ranks: docs/benchmarks.md, "The adapters stay fp32")."""
    zero_init = _items(3, Precision.BF16)  # training.model_init auto: zero.Init at ZeRO-3, as HF Trainer does
    assert zero_init["bf16 parameter partition (the adapters' in fp32)"] == 2 * 750 + 2 * 40
    assert zero_init["persistent parameters (≤ 200 elements each) (the adapters' in fp32)"] == 2 * 100 + 2 * 80
    assert zero_init["bf16 gradient partition"] == 2 * 40  # gradient_accumulation_dtype: the training dtype
    built_whole = _items(3, Precision.BF16, TrainingSpec(global_batch_size=4, micro_batch_size=2, sequence_length=16,
                                                         model_init=ModelInit.FULL))  # the engine casts them
    assert built_whole["bf16 parameter partition"] == 2 * 750
    assert built_whole["persistent parameters (≤ 200 elements each)"] == 2 * 100
    assert _items(3, Precision.FP32)["fp32 parameter partition"] == 4 * 750  # nothing to upcast
