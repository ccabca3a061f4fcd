"""DeepSpeed's real constraints: invalid combinations are reported with their reason, never fixed."""

from __future__ import annotations

import pytest

from optimizer.ledger.core import InvalidCandidate, compute_ledger, evaluate
from optimizer.study.constraints import gradient_accumulation_steps, invalid_reasons
from optimizer.study.knobs import Precision, with_knobs
from optimizer.study.specs import (
    Accelerator,
    HardwareSpec,
    SeedModel,
    TrainingSpec,
    TransformerModel,
    baseline_candidate,
)

MODEL = TransformerModel(layers=4, hidden_size=64, heads=4, kv_heads=4, ffn_size=256, vocab_size=128)
GPU = HardwareSpec(gpus_per_node=2, gpu_memory_bytes=8 * 10**9)
CPU = HardwareSpec(accelerator=Accelerator.CPU, gpus_per_node=2, gpu_memory_bytes=8 * 10**9,
                   supported_precisions=(Precision.FP32, Precision.BF16))
TRAINING = TrainingSpec(global_batch_size=16, micro_batch_size=2, sequence_length=32)


def candidate(**knobs):
    return with_knobs(baseline_candidate(TRAINING), knobs)


def reasons(hardware=GPU, model=MODEL, **knobs):
    return invalid_reasons(candidate=candidate(**knobs), model=model, hardware=hardware, training=TRAINING)


@pytest.mark.parametrize(
    ("knobs", "why"),
    [
        ({"offload_optimizer": "cpu"}, "offload_optimizer needs zero_stage >= 1"),
        ({"zero_stage": 2, "offload_optimizer": "nvme"}, "offload_optimizer=nvme needs zero_stage 3"),
        ({"zero_stage": 1, "offload_optimizer": "nvme"}, "offload_optimizer=nvme needs zero_stage 3"),
        ({"zero_stage": 2, "offload_param": "cpu"}, "offload_param needs zero_stage 3"),
        ({"micro_batch_size": 3}, "does not divide global_batch_size=16"),
        ({"checkpointing": "every_5"}, "checkpoints no block of a 4-layer model"),
        ({"zero_stage": 3, "offload_param": "nvme"}, "NVMe offload needs hardware.nvme_path"),
    ],
)
def test_invalid_combinations_say_why(knobs, why):
    found = reasons(**knobs)
    assert any(why in r for r in found), found


def test_fp16_on_cpu_ranks_is_invalid_but_bf16_is_fine():
    assert any("fp16 is not supported on these cpu devices" in r for r in reasons(hardware=CPU, precision="fp16"))
    assert reasons(hardware=CPU, precision="bf16") == ()
    assert reasons(precision="fp16") == ()


def test_valid_stage3_offloads():
    assert reasons(zero_stage=3, offload_optimizer="cpu", offload_param="cpu") == ()
    assert reasons(zero_stage=1, offload_optimizer="cpu") == ()


def test_all_reasons_are_reported_together():
    found = reasons(offload_optimizer="cpu", offload_param="cpu", micro_batch_size=3)
    assert len(found) == 3


def test_seed_mode_needs_a_stated_activation_figure():
    seed = SeedModel(parameters=10**9, activation_bytes={"none": 8 * 10**9, "full": 3 * 10**9})
    assert any("no activation figure for checkpointing=every_2" in r
               for r in reasons(model=seed, checkpointing="every_2"))


def test_compute_ledger_refuses_and_evaluate_reports():
    bad = candidate(offload_optimizer="cpu")
    with pytest.raises(InvalidCandidate) as info:
        compute_ledger(candidate=bad, model=MODEL, hardware=GPU, training=TRAINING)
    assert "zero_stage >= 1" in str(info.value)
    verdict = evaluate(candidate=bad, model=MODEL, hardware=GPU, training=TRAINING)
    assert verdict.ledger is None and not verdict.fits and verdict.invalid_reasons == info.value.reasons


def test_gradient_accumulation_keeps_the_global_batch():
    assert gradient_accumulation_steps(candidate=candidate(micro_batch_size=2), hardware=GPU, training=TRAINING) == 4
    assert gradient_accumulation_steps(candidate=candidate(micro_batch_size=8), hardware=GPU, training=TRAINING) == 1
