"""Every model-state item of seven candidates, whole: name, formula, bytes, place, phase and kind (optimizer/ledger/
model_states.py, on a CUDA device so that no CPU-rank item enters). The model is grid-cpu's GPT (tests/
test_zero12_phases.py counts it by hand): Ψ = 120,576 on N = 2 ranks, P = Q = S = Ψ/2 = 60,288 (no padding: Ψ is
a multiple of 2N), the largest tensor Lₜ = 64·256 = 16,384 elements, the bucket B = h² = 4,096 and the worst
rank's gradient partition Σ = 70,400 elements (its own tensors in full). ZeRO-3: the persistent parameters K =
1,792 elements (every tensor ≤ 640 elements: per block ln_1 and ln_2 2·2·64, the c_attn bias 192, the c_proj
biases 2·64, the c_fc bias 256 = 832, × 2 blocks, + ln_f 128), the largest module LL = the c_fc Linear, 64·256 +
256 = 16,640 elements, prefetch and reuse 0.9·h² = 3,686 elements (DeepSpeed's "auto" sizes,
optimizer/deepspeed/zero_settings.py). Global batch 8 at micro-batch 2 on 2 ranks: two micro-batches a step.

The figures, by hand: 2Ψ = 241,152, 4Ψ = 482,304, 8Ψ = 964,608; 2P = 120,576, 4P = 241,152, 6P = 361,728,
8P = 482,304 (Q and S alike); 2Σ = 140,800, 4Σ = 281,600; 2·B = 8,192, 4·B = 16,384; 2Lₜ = 32,768,
4Lₜ = 65,536, 8Lₜ = 131,072 (ZeRO-1/2's step: max(8Lₜ, 6P) = 361,728 in bf16, max(8Lₜ, 4P) = 241,152 in fp32;
ZeRO-2 offload's fp64 norm 8Lₚ with the piece Lₚ = Lₜ = 131,072); 2K = 3,584; 2·2·LL = 66,560; 2 × 3,686 = 7,372;
ZeRO-3 offload's boundary gradient 2·⌈Lₜ/N⌉ + 8·⌈Lₜ/N⌉ = 10 · 8,192 = 81,920. Why each item is there, and where
DeepSpeed allocates it, is in model_states.py's citations and docs/ledger.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from optimizer.ledger.core import compute_ledger
from optimizer.ledger.items import Category
from optimizer.ledger.transformer import parameter_count
from optimizer.study.knobs import Precision, parse_knob, with_knobs
from optimizer.study.specs import ActivationSource, baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[1]

TABLES = {
    "z0 fp32 ckpt=none mbs=2": [
        (482_304, "gpu", "always", "params", "4Ψ", "fp32 parameters"),
        (482_304, "gpu", "always", "grads", "4Ψ", "fp32 gradients"),
        (964_608, "gpu", "always", "optimizer", "8Ψ", "Adam exp_avg + exp_avg_sq (fp32)"),
        (482_304, "gpu", "reduce", "buffers", "4·min(Ψ, 5e8 + Lₜ)", "allreduce flatten (≤ 5e8 + Lₜ elements)"),
        (482_304, "gpu", "init", "params", "4Ψ", "whole model built on the device in fp32"),
    ],
    "z0 bf16 ckpt=none mbs=2": [
        (241_152, "gpu", "always", "params", "2Ψ", "bf16 parameters"),
        (241_152, "gpu", "always", "grads", "2Ψ", "bf16 gradients"),
        (964_608, "gpu", "always", "optimizer", "8Ψ", "Adam exp_avg + exp_avg_sq (fp32)"),
        (241_152, "gpu", "reduce", "buffers", "2·min(Ψ, 5e8 + Lₜ)", "allreduce flatten (≤ 5e8 + Lₜ elements)"),
        (482_304, "gpu", "always", "master_weights", "4Ψ", "fp32 master weights (flat)"),
        (964_608, "gpu", "step", "grads", "8Ψ", "fp32 gradient list + flat copy in step"),
        (241_152, "gpu", "init", "params", "2Ψ", "bf16 parameters (flat)"),
        (482_304, "gpu", "init", "master_weights", "4Ψ", "fp32 master weights (flat)"),
        (482_304, "gpu", "init", "grads", "4Ψ", "zero fp32 gradients for the initial step"),
        (964_608, "gpu", "init", "optimizer", "8Ψ", "Adam exp_avg + exp_avg_sq (fp32)"),
    ],
    "z1 bf16 ckpt=none mbs=2": [
        (241_152, "gpu", "always", "params", "2Ψ", "bf16 parameters (flat, full)"),
        (8_192, "gpu", "always", "buffers", "1·2·B", "gradient bucket (reduce_bucket_size = 4,096)"),
        (241_152, "gpu", "backward", "grads", "2Ψ", "bf16 gradients (full, until reduced)"),
        (241_152, "gpu", "reduce", "grads", "2Ψ", "bf16 gradients (full, until reduced)"),
        (241_152, "gpu", "always", "master_weights", "4P", "fp32 master partition"),
        (482_304, "gpu", "always", "optimizer", "8P", "Adam exp_avg + exp_avg_sq (fp32)"),
        (
            140_800,
            "gpu",
            "reduce",
            "grads",
            "2Σ",
            "bf16 gradient partition (grads_in_partition, allocated at the first reduction)",
        ),
        (8_192, "gpu", "reduce", "buffers", "2·B", "reduction flatten (≤ one bucket)"),
        (140_800, "gpu", "step", "grads", "2Σ", "bf16 gradient partition (until step)"),
        (361_728, "gpu", "step", "grads", "max(8Lₜ, 6P)", "flat + fp32 gradient partition in step"),
        (241_152, "gpu", "init", "params", "2Ψ₁₂", "bf16 parameters (flat, full)"),
        (241_152, "gpu", "init", "master_weights", "4P", "fp32 master partition"),
        (241_152, "gpu", "init", "grads", "4P", "zero fp32 gradient partition"),
    ],
    "z2 fp32 ckpt=none mbs=2": [
        (482_304, "gpu", "always", "params", "4Ψ", "fp32 parameters (flat, full)"),
        (16_384, "gpu", "backward", "buffers", "1·4·B", "gradient bucket (reduce_bucket_size = 4,096)"),
        (241_152, "gpu", "always", "master_weights", "4P", "fp32 master partition"),
        (482_304, "gpu", "always", "optimizer", "8P", "Adam exp_avg + exp_avg_sq (fp32)"),
        (281_600, "gpu", "backward", "grads", "4Σ", "fp32 gradient partition of the earlier micro-batches (GAS > 1)"),
        (
            281_600,
            "gpu",
            "backward",
            "grads",
            "4Σ",
            "fp32 gradient partition (grads_in_partition, allocated at the first reduction)",
        ),
        (16_384, "gpu", "backward", "buffers", "4·B", "reduction flatten (≤ one bucket)"),
        (281_600, "gpu", "step", "grads", "4Σ", "fp32 gradient partition (until step)"),
        (241_152, "gpu", "step", "grads", "max(8Lₜ, 4P)", "flat + fp32 gradient partition in step"),
        (65_536, "gpu", "backward", "grads", "4Lₜ", "gradient larger than the bucket, reduced in place"),
        (482_304, "gpu", "init", "params", "4Ψ", "fp32 parameters as built"),
        (482_304, "gpu", "init", "params", "4Ψ₁₂", "fp32 flat copy (padded to 2N)"),
    ],
    "z2 bf16 ckpt=none mbs=2 opt->cpu": [
        (241_152, "gpu", "always", "params", "2Ψ", "bf16 parameters (flat, full)"),
        (8_192, "gpu", "backward", "buffers", "1·2·B", "gradient bucket (reduce_bucket_size = 4,096)"),
        (241_152, "host", "always", "master_weights", "4P", "fp32 master partition"),
        (482_304, "host", "always", "optimizer", "8P", "Adam exp_avg + exp_avg_sq (fp32)"),
        (241_152, "host", "always", "grads", "4P", "fp32 gradient partition (pinned)"),
        (120_576, "host", "always", "buffers", "2P", "bf16 parameter staging partition (pinned)"),
        (32_768, "host", "always", "buffers", "2Lₜ", "temp_grad_buffer_for_cpu_offload (pinned)"),
        (32_768, "gpu", "always", "buffers", "2Lₜ", "temp_grad_buffer_for_gpu_offload"),
        (
            131_072,
            "gpu",
            "backward",
            "buffers",
            "8Lₚ",
            "fp64 norm of one parameter's piece of the partition (at the boundary)",
        ),
        (140_800, "host", "always", "grads", "2Σ", "accumulated gradients on host (GAS > 1, pinned)"),
        (241_152, "gpu", "init", "params", "2Ψ", "bf16 parameters as built"),
        (241_152, "gpu", "init", "params", "2Ψ₁₂", "bf16 flat copy (padded to 2N)"),
        (241_152, "host", "init", "master_weights", "4P", "fp32 master partition"),
        (241_152, "host", "init", "grads", "4P", "zero fp32 gradient partition"),
        (120_576, "host", "init", "buffers", "2P", "bf16 parameter staging partition (pinned)"),
    ],
    "z3 bf16 ckpt=none mbs=2": [
        (120_576, "gpu", "always", "params", "2Q", "bf16 parameter partition"),
        (3_584, "gpu", "always", "params", "2K", "persistent parameters (≤ 640 elements each)"),
        (66_560, "gpu", "backward", "buffers", "2·2·LL", "gathered largest module + its full gradient"),
        (
            7_372,
            "gpu",
            "backward",
            "buffers",
            "2·prefetch",
            "prefetched parameters (stage3_prefetch_bucket_size = 3,686)",
        ),
        (
            7_372,
            "gpu",
            "backward",
            "buffers",
            "2·reuse",
            "parameters kept for reuse (stage3_max_reuse_distance = 3,686)",
        ),
        (8_192, "gpu", "always", "buffers", "2·B", "gradient bucket (reduce_bucket_size = 4,096)"),
        (8_192, "gpu", "backward", "buffers", "2·B", "reduce-scatter concat (≤ one bucket)"),
        (120_576, "gpu", "always", "grads", "2Q", "bf16 gradient partition"),
        (241_152, "gpu", "always", "master_weights", "4Q", "fp32 master partition"),
        (482_304, "gpu", "always", "optimizer", "8Q", "Adam exp_avg + exp_avg_sq (fp32)"),
        (361_728, "gpu", "step", "grads", "max(6S, 8⌈Lₜ/N⌉)", "flat + fp32 gradient sub-group in step"),
        (120_576, "gpu", "init", "params", "2Q", "bf16 parameter partition (flat)"),
        (241_152, "gpu", "init", "master_weights", "4Q", "fp32 master partition"),
        (8_192, "gpu", "init", "buffers", "2·B", "gradient bucket (reduce_bucket_size = 4,096)"),
        (241_152, "gpu", "init", "grads", "4S", "zero fp32 gradient sub-group for optimizer set-up"),
        (120_576, "host", "init", "buffers", "2Q", "bf16 defragmentation buffer (host)"),
    ],
    "z3 bf16 ckpt=none mbs=2 opt->cpu param->cpu": [
        (120_576, "host", "always", "params", "2Q", "bf16 parameter partition (pinned)"),
        (3_584, "gpu", "always", "params", "2K", "persistent parameters (≤ 640 elements each)"),
        (66_560, "gpu", "backward", "buffers", "2·2·LL", "gathered largest module + its full gradient"),
        (
            7_372,
            "gpu",
            "backward",
            "buffers",
            "2·prefetch",
            "prefetched parameters (stage3_prefetch_bucket_size = 3,686)",
        ),
        (
            7_372,
            "gpu",
            "backward",
            "buffers",
            "2·reuse",
            "parameters kept for reuse (stage3_max_reuse_distance = 3,686)",
        ),
        (8_192, "gpu", "always", "buffers", "2·B", "gradient bucket (reduce_bucket_size = 4,096)"),
        (8_192, "gpu", "backward", "buffers", "2·B", "reduce-scatter concat (≤ one bucket)"),
        (120_576, "host", "always", "grads", "2Q", "bf16 gradient partition (pinned)"),
        (
            81_920,
            "gpu",
            "backward",
            "buffers",
            "2·⌈Lₜ/N⌉ + 8·⌈Lₜ/N⌉",
            "one parameter's gradient partition at the boundary + its fp64 norm",
        ),
        (241_152, "host", "always", "master_weights", "4Q", "fp32 master partition"),
        (241_152, "host", "always", "grads", "4Q", "fp32 gradient partition (pinned)"),
        (482_304, "host", "always", "optimizer", "8Q", "Adam exp_avg + exp_avg_sq (fp32)"),
        (8_192, "gpu", "init", "buffers", "2·B", "gradient bucket (reduce_bucket_size = 4,096)"),
        (66_560, "gpu", "init", "params", "2·2·LL", "largest module gathered"),
        (120_576, "host", "init", "params", "2Q", "bf16 parameter partition (flat, pinned)"),
        (241_152, "host", "init", "master_weights", "4Q", "fp32 master partition"),
        (241_152, "host", "init", "grads", "4S", "zero fp32 gradient sub-group for optimizer set-up"),
        (241_152, "host", "init", "grads", "4Q", "fp32 gradient partition (pinned)"),
        (241_152, "host", "init", "buffers", "4S", "one sub-group's zero gradient while it is pinned"),
    ],
}


def _knobs(label: str) -> dict:
    """'z2 bf16 ckpt=none mbs=2 opt->cpu param->cpu' → the knobs."""
    words = label.split()
    knobs = {"zero_stage": int(words[0][1]), "precision": words[1], "micro_batch_size": int(words[3][4:])}
    for word in words[4:]:
        name, device = word.split("->")
        knobs["offload_optimizer" if name == "opt" else "offload_param"] = device
    return {
        name: parse_knob(name, str(value)) if name != "micro_batch_size" else value for name, value in knobs.items()
    }


@pytest.fixture(scope="module")
def study():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    assert parameter_count(study.model) == 120_576
    model = dataclasses.replace(study.model, activations=ActivationSource.FORMULA)
    gpu = dataclasses.replace(
        study.hardware, accelerator="cuda", supported_precisions=(Precision.FP32, Precision.BF16, Precision.FP16)
    )
    return dataclasses.replace(study, model=model, hardware=gpu)


@pytest.mark.parametrize("label", list(TABLES))
def test_every_model_state_item_as_worked_by_hand(study, label):
    candidate = with_knobs(baseline_candidate(study.training), _knobs(label))
    assert candidate.label() == label
    ledger = compute_ledger(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)
    items = [
        (i.bytes, i.location.value, i.phase.value, i.category.value, i.formula, i.name)
        for i in ledger.items
        if i.category is not Category.ACTIVATIONS
    ]
    assert items == TABLES[label]
    assert ledger.risks == ()  # nothing sometimes-live off CPU ranks
