"""Transformer-mode model states against DeepSpeed's own estimators (mixed precision, bf16).

DeepSpeed's estimators (``stage_1_and_2.py: estimate_zero2_model_states_mem_needs``,
``stage3.py: estimate_zero3_model_states_mem_needs`` — what the ``*_all_cold`` helpers print) count
model states only, with round per-parameter multipliers. The ledger follows what the code allocates
(DeepSpeed 0.19.8 source audit); each deliberate difference is written out below as an exact term,
so a change on either side fails the test.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from deepspeed.runtime.zero.stage3 import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
)
from deepspeed.runtime.zero.stage_1_and_2 import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
)

from optimizer.knobs import (
    Candidate,
    NoCheckpointing,
    OffloadDevice,
    Precision,
    ZeroStage,
)
from optimizer.ledger import compute_ledger
from optimizer.ledger_items import Category, Location, Phase
from optimizer.specs import HardwareSpec, TrainingSpec, TransformerModel
from optimizer.transformer import largest_layer_parameters, largest_tensor_parameters, parameter_tensors

N = 4
MODEL = TransformerModel(layers=24, hidden_size=2048, heads=16, kv_heads=16, ffn_size=8192, vocab_size=50257,
                         max_positions=2048)
HARDWARE = HardwareSpec(gpus_per_node=N, gpu_memory_bytes=80 * 2**30)
TRAINING = TrainingSpec(global_batch_size=N, micro_batch_size=1, sequence_length=2048)  # no accumulation
TENSORS = parameter_tensors(MODEL)
PSI = sum(t.numel for t in TENSORS)
LL = largest_layer_parameters(MODEL)
LT = largest_tensor_parameters(MODEL)
PADDED = -(-PSI // (2 * N)) * (2 * N)  # ZeRO-1/2 flat buffer, aligned to 2N (stage_1_and_2.py:387,441)
P = PADDED // N
SIGMA = P + 2 * LT  # grads_in_partition: boundary-straddling tensors count in full
Q = sum(-(-t.numel // N) for t in TENSORS)  # ZeRO-3 partition: per-tensor ceil(n/N)
STATE_CATEGORIES = (Category.PARAMS, Category.GRADS, Category.MASTER_WEIGHTS, Category.OPTIMIZER)


def ledger(stage, optimizer=OffloadDevice.NONE, param=OffloadDevice.NONE):
    candidate = Candidate(zero_stage=stage, offload_optimizer=optimizer, offload_param=param,
                          precision=Precision.BF16, checkpointing=NoCheckpointing(), micro_batch_size=1)
    return compute_ledger(candidate=candidate, model=MODEL, hardware=HARDWARE, training=TRAINING)


def gpu_states(led, phase):
    """GPU model-state bytes live in ``phase`` (params, grads, master weights, optimizer states)."""
    return sum(i.bytes for i in led.items
               if i.location is Location.GPU and i.category in STATE_CATEGORIES and i.phase in (Phase.ALWAYS, phase))


def printed_gib(printer, **kwargs):
    """The per-GPU figures (GiB, printed as 'GB') of DeepSpeed's ``*_all_cold`` table, in row order."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        printer(**kwargs)
    return [float(x) for x in re.findall(r"\|\s+([0-9.]+)GB \|", out.getvalue())]


def test_all_cold_prints_the_functions_we_compare_with():
    rows = printed_gib(estimate_zero2_model_states_mem_needs_all_cold, total_params=PSI, num_gpus_per_node=N)
    _, gpu_offload = estimate_zero2_model_states_mem_needs(PSI, N, 1, cpu_offload=True)
    _, gpu = estimate_zero2_model_states_mem_needs(PSI, N, 1, cpu_offload=False)
    assert rows == [round(gpu_offload / 2**30, 2), round(gpu / 2**30, 2)]
    rows3 = printed_gib(estimate_zero3_model_states_mem_needs_all_cold, total_params=PSI, largest_layer_params=LL,
                        num_gpus_per_node=N)
    _, gpu3, _ = estimate_zero3_model_states_mem_needs(PSI, LL, N, 1, cpu_offload=False, cpu_offload_params=False)
    assert rows3[-1] == round(gpu3 / 2**30, 2)


def test_zero2_matches_estimator_plus_the_step_copies_it_omits():
    _, estimator = estimate_zero2_model_states_mem_needs(PSI, N, 1, cpu_offload=False)  # 2Ψ + 18Ψ/N
    assert 6 * P > 8 * LT  # the step transient is the flat + fp32 partition here, not the fp64 norm copy
    ours = gpu_states(ledger(ZeroStage.GRADIENTS), Phase.STEP)
    # The estimator's 18 = 2 (bf16 grads) + 4 (fp32 grads) + 4 (fp32 master) + 8 (Adam) per partition element.
    # In step DeepSpeed holds grads_in_partition (2Σ) *and* its flattened copy (2P) at once
    # (stage_1_and_2.py:3117-3119), and its flat buffer is padded to a multiple of 2N.
    assert ours == estimator + 2 * (PADDED - PSI) + (18 * P - 18 * PSI // N) + 2 * SIGMA


def test_zero2_cpu_offload_gpu_side_is_the_estimators_2psi():
    _, estimator = estimate_zero2_model_states_mem_needs(PSI, N, 1, cpu_offload=True)  # 2Ψ
    led = ledger(ZeroStage.GRADIENTS, optimizer=OffloadDevice.CPU)
    assert gpu_states(led, Phase.BACKWARD) == estimator + 2 * (PADDED - PSI)
    # Host, per rank: master 4P + fp32 grads 4P + Adam 8P (the estimator's 16), plus the pinned bf16
    # staging partition (2P) and the unused temp_grad_buffer_for_cpu_offload (2Lₜ) it leaves out.
    steady = sum(i.bytes for i in led.items if i.location is Location.HOST and i.phase is Phase.ALWAYS)
    assert steady == 16 * P + 2 * P + 2 * LT


def test_zero3_matches_estimator_plus_the_grad_partition_and_step_copy():
    _, estimator, largest_layer_memory = estimate_zero3_model_states_mem_needs(
        PSI, LL, N, 1, cpu_offload=False, cpu_offload_params=False)  # 4·LL + 18Ψ/N
    led = ledger(ZeroStage.PARAMETERS)
    gathered = next(i for i in led.items if i.name.startswith("gathered largest module"))
    assert gathered.bytes == largest_layer_memory  # 2 bytes param + 2 bytes grad per element: 4·LL
    persistent = next(i for i in led.items if i.name.startswith("persistent parameters")).bytes
    ours = gpu_states(led, Phase.STEP) - persistent
    # Ledger in step: bf16 partition 2Q + bf16 grad partition 2Q (persistent, stage3.py:791-796)
    # + master 4Q + Adam 8Q + flat bf16 and fp32 grad copies 6S (S = Q here, stage3.py:2686-2687) = 22Q.
    # The estimator's 18 has no 16-bit grad partition and one 16-bit copy fewer: +4Q.
    assert ours == (estimator - largest_layer_memory) + (18 * Q - 18 * PSI // N) + 4 * Q


def test_zero3_optimizer_offload_gpu_side():
    _, estimator, largest_layer_memory = estimate_zero3_model_states_mem_needs(
        PSI, LL, N, 1, cpu_offload=True, cpu_offload_params=False)  # 4·LL + 2Ψ/N
    led = ledger(ZeroStage.PARAMETERS, optimizer=OffloadDevice.CPU)
    partition = next(i for i in led.items if i.name == "bf16 parameter partition")
    gathered = next(i for i in led.items if i.name.startswith("gathered largest module"))
    assert partition.location is Location.GPU
    assert partition.bytes + gathered.bytes == estimator + (2 * Q - 2 * PSI // N)
    assert gathered.bytes == largest_layer_memory


def test_zero3_full_offload_leaves_only_the_gather_on_gpu():
    _, estimator, _ = estimate_zero3_model_states_mem_needs(PSI, LL, N, 1, cpu_offload=True,
                                                            cpu_offload_params=True)  # 4·LL
    led = ledger(ZeroStage.PARAMETERS, optimizer=OffloadDevice.CPU, param=OffloadDevice.CPU)
    gathered = next(i for i in led.items if i.name.startswith("gathered largest module"))
    assert gathered.bytes == estimator
    partition = next(i for i in led.items if i.name.startswith("bf16 parameter partition"))
    assert partition.location is Location.HOST


@pytest.mark.parametrize("stage", [ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS, ZeroStage.PARAMETERS])
def test_fp32_training_still_keeps_a_separate_fp32_master_partition(stage):
    # stage_1_and_2.py:560 clones the partition; stage3.py:1162-1167's alias never fires.
    candidate = Candidate(zero_stage=stage, offload_optimizer=OffloadDevice.NONE, offload_param=OffloadDevice.NONE,
                          precision=Precision.FP32, checkpointing=NoCheckpointing(), micro_batch_size=1)
    led = compute_ledger(candidate=candidate, model=MODEL, hardware=HARDWARE, training=TRAINING)
    per_rank = Q if stage is ZeroStage.PARAMETERS else P
    assert led.per_gpu()["master_weights"] == 4 * per_rank
