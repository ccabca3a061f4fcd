"""The throughput model's work for a model that trains in part (issue 36, item 5), counted by hand: a frozen
embedding, a frozen base weight with LoRA A and B beside it and a frozen norm — Ψ = 1,500, Ψtr = 80 — on 2 ranks.

The backward of ``torch.nn.functional.linear`` computes ``grad_weight`` only where the weight requires a gradient
and ``grad_input`` only where its input does (``needs_input_grad``); DeepSpeed reduces, gathers and steps the
trainable tensors alone below ZeRO-3 (``stage_1_and_2.py:428-434``) and gathers every tensor at ZeRO-3."""

from __future__ import annotations

import pytest

from optimizer.perf.throughput import backward_share, work
from optimizer.study.inventory import InventoryTensor, ParameterInventory
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import (
    ActivationSource,
    HardwareSpec,
    PositionKind,
    TrainingSpec,
    TransformerModel,
    baseline_candidate,
)

V, H, S = 50, 20, 16


def _model(tensors: list[tuple[str, str, tuple[int, ...], bool]]) -> TransformerModel:
    inventory = ParameterInventory(tensors=tuple(
        InventoryTensor(name=f"{m}.weight", module=m, module_type=t, shape=s, dtype="float32", trainable=tr)
        for m, t, s, tr in tensors), model_class="PeftModel")
    return TransformerModel(layers=1, hidden_size=H, heads=2, kv_heads=2, ffn_size=80, vocab_size=V,
                            max_positions=S, position_embedding=PositionKind.ROPE,
                            activations=ActivationSource.FORMULA, inventory=inventory)


LORA = [("embed_tokens", "Embedding", (V, H), False),
        ("layers.0.attn.q.base_layer", "Linear", (H, H), False),
        ("layers.0.attn.q.lora_A.default", "Linear", (2, H), True),
        ("layers.0.attn.q.lora_B.default", "Linear", (H, 2), True),
        ("layers.0.attn.o", "Linear", (H, H), False),
        ("final_norm", "RMSNorm", (H,), False)]
FULL = [(m, t, s, True) for m, t, s, _ in LORA]
HARDWARE = HardwareSpec(gpus_per_node=2, gpu_memory_bytes=10**9)


def _work(model: TransformerModel, *, global_batch: int = 4, **knobs: object):
    training = TrainingSpec(global_batch_size=global_batch, micro_batch_size=2, sequence_length=S)
    candidate = with_knobs(baseline_candidate(training), knobs)
    return work(candidate=candidate, model=model, hardware=HARDWARE, training=training)


# Ψ = 1,000 (tied embedding) + 400 + 40 + 40 + 400 + 20 = 1,900; blocks N = 900; attention scores 2·L·s·h = 640;
# forward per token F = 2·900 + 640 + 2·V·h (2,000) = 4,440; a full fine-tune trains 3F = 13,320 per token.
PSI, PSI_TR, F = 1_900, 80, 4_440


def test_a_full_fine_tune_is_three_forwards_with_or_without_an_inventory():
    full = _model(FULL)
    assert backward_share(full) is None
    assert _work(full).flops / _work(full).tokens == 3 * F


def test_lora_computes_the_adapters_weight_gradients_and_no_input_gradient_below_them():
    lora = _model(LORA)
    share = backward_share(lora)
    # the base q weight comes before the first trainable tensor: its input does not require a gradient (embedding
    # and norm frozen), so neither of its backward GEMMs runs; A, B train; the head (tied, frozen) does not
    assert share is not None
    assert (share.trainable_blocks, share.head_trains, share.frozen_prefix, share.below_head) == (80, False, 400, True)
    # backward = (1 − 400/900)·(2·900 + 2·640) input gradients and attention + 2·V·h (the head's input gradient)
    #          + 2·80 (the adapters' weight gradients) = 5/9 · 3,080 + 2,000 + 160 = 3,871.1
    per_token = _work(lora).flops / _work(lora).tokens
    assert per_token == pytest.approx(F + 5 / 9 * 3_080 + 2_000 + 160)
    assert per_token < 3 * F * 0.7


def test_a_trained_tied_embedding_trains_the_head_and_sends_gradients_to_the_bottom():
    embed = _model([(m, t, s, m == "embed_tokens") for m, t, s, _ in LORA])
    share = backward_share(embed)
    assert share is not None and (share.head_trains, share.frozen_prefix, share.trainable_blocks) == (True, 0, 0)
    # input gradients through everything (2·900 + 2·640 + 2,000) and the head's weight gradient (2,000)
    assert _work(embed).flops / _work(embed).tokens == F + 3_080 + 2_000 + 2_000


def test_only_the_head_trains_no_input_gradient_flows_at_all():
    head = _model([*[(m, t, s, False) for m, t, s, _ in LORA], ("lm_head", "Linear", (V, H), True)])
    head = TransformerModel(**{**{f: getattr(head, f) for f in head.__dataclass_fields__}, "tied_embeddings": False})
    share = backward_share(head)
    assert share is not None and (share.head_trains, share.below_head, share.frozen_prefix) == (True, False, 900)
    assert _work(head).flops / _work(head).tokens == F + 2_000  # the head's weight gradient alone


@pytest.mark.parametrize(("stage", "z02", "z3"), [
    # ring (W − 1)/W = 1/2, fp32 4 bytes, one micro-step: ZeRO-0/1/2 reduce and gather the trainable 2Ψtr;
    # ZeRO-3 gathers every tensor twice and reduce-scatters the trainable ones, 2Ψ + Ψtr
    (0, 2 * 0.5 * PSI_TR * 4, 0), (1, 2 * 0.5 * PSI_TR * 4, 0), (2, 2 * 0.5 * PSI_TR * 4, 0),
    (3, 0, 0.5 * (2 * PSI + PSI_TR) * 4),
])
def test_communication_moves_the_trainable_gradients_and_every_gathered_parameter(stage, z02, z3):
    job = _work(_model(LORA), zero_stage=stage)
    assert (job.comm_bytes, job.comm_bytes_z3) == (z02, z3)


def test_the_offloaded_optimizer_steps_and_moves_the_trainable_partition_only():
    job = _work(_model(LORA), zero_stage=2, offload_optimizer="cpu")
    assert job.host_params == PSI_TR / 2 and job.pcie_bytes == 2 * PSI_TR / 2 * 4
    nvme = _work(_model(LORA), zero_stage=3, offload_optimizer="nvme", offload_param="cpu")
    # the parameters' partitions (frozen too) cross PCIe in forward and backward; the states swap over Ψtr
    assert nvme.pcie_bytes == 2 * PSI_TR / 2 * 4 + 2 * PSI / 2 * 4 and nvme.nvme_bytes == 2 * 12 * PSI_TR / 2
