"""Model states against figures from outside the ledger: the ZeRO paper's worked example, DeepSpeed's estimators.

* **ZeRO paper** (Rajbhandari et al. 2020, Fig. 1): Ψ = 7.5B parameters, N_d = 64 devices, K = 12 bytes of
  optimizer state per parameter (mixed-precision Adam): per device 120 GB (baseline), 31.4 GB (P_os),
  16.6 GB (P_os+g), 1.9 GB (P_os+g+p). The seed mode (stated parameter count) must reproduce them.
* **DeepSpeed 0.19.8's estimators**, called here (``stage_1_and_2.py: estimate_zero2_model_states_mem_needs``,
  ``stage3.py: estimate_zero3_model_states_mem_needs``). Their source comment names the per-parameter terms
  (ZeRO-2: "2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit +
  8_optimizer_states_32bit"); each ledger item is compared with the estimator's figure for the term it holds.
  What the estimators leave out (DeepSpeed allocates it, see optimizer/ledger/model_states.py) is bounded or
  counted by hand, not re-derived with the ledger's formulas.

The transformer below is chosen so that DeepSpeed's alignment changes nothing: Ψ is a multiple of 2N (no
ZeRO-1/2 padding) and every tensor's size a multiple of N (ZeRO-3's per-tensor partitions add up to Ψ/N).
"""

from __future__ import annotations

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from optimizer.ledger.core import compute_ledger
from optimizer.ledger.items import Category, Location, Phase
from optimizer.ledger.transformer import FlatPartition, parameter_count, zero12_partition
from optimizer.study.knobs import Candidate, NoCheckpointing, OffloadDevice, Precision, ZeroStage
from optimizer.study.specs import Accelerator, HardwareSpec, SeedModel, TrainingSpec, TransformerModel

GB = 10**9
GIB = 2**30
N = 4
MODEL = TransformerModel(layers=24, hidden_size=2048, heads=16, kv_heads=16, ffn_size=8192, vocab_size=50257,
                         max_positions=2048)
HARDWARE = HardwareSpec(gpus_per_node=N, gpu_memory_bytes=80 * 2**30)
TRAINING = TrainingSpec(global_batch_size=N, micro_batch_size=1, sequence_length=2048)  # no accumulation
# Ψ by hand (GPT-2 layout, biases, learned positions, tied head): per layer q, k, v, o 4·(2048² + 2048)
# = 16,785,408, two LayerNorms 2·2·2048 = 8,192, MLP 2048·8192 + 8192 + 8192·2048 + 2048 = 33,564,672:
# 50,358,272 × 24 = 1,208,598,528; token embedding 50257·2048 = 102,926,336; positions 2048·2048 = 4,194,304;
# final LayerNorm 4,096.
PSI = 1_315_723_264
LARGEST_TENSOR = 50257 * 2048  # the token embedding (= the largest layer, the LM head being tied)
STATE_CATEGORIES = (Category.PARAMS, Category.GRADS, Category.MASTER_WEIGHTS, Category.OPTIMIZER)


def ledger(stage, optimizer=OffloadDevice.NONE, param=OffloadDevice.NONE, precision=Precision.BF16, model=MODEL,
           hardware=HARDWARE):
    candidate = Candidate(zero_stage=stage, offload_optimizer=optimizer, offload_param=param,
                          precision=precision, checkpointing=NoCheckpointing(), micro_batch_size=1)
    return compute_ledger(candidate=candidate, model=model, hardware=hardware, training=TRAINING)


def item(led, name, location=Location.GPU):
    """The bytes of the one training-time item called ``name…`` at ``location``."""
    found = [i for i in led.items if i.name.startswith(name) and i.location is location and i.phase is not Phase.INIT]
    assert len(found) == 1, [i.name for i in led.items]
    return found[0].bytes


def gpu_states(led, phase):
    """GPU model-state bytes live in ``phase`` (params, grads, master weights, optimizer states)."""
    return sum(i.bytes for i in led.items
               if i.location is Location.GPU and i.category in STATE_CATEGORIES and i.phase in (Phase.ALWAYS, phase))


def test_the_model_has_the_hand_counted_parameters_and_no_alignment_padding():
    assert parameter_count(MODEL) == PSI
    assert PSI % (2 * N) == 0 and LARGEST_TENSOR % N == 0 and 2048 % N == 0 and 8192 % N == 0


@pytest.mark.parametrize(("stage", "figure_gb"), [(ZeroStage.DISABLED, 120.0), (ZeroStage.OPTIMIZER, 31.4),
                                                  (ZeroStage.GRADIENTS, 16.6), (ZeroStage.PARAMETERS, 1.9)])
def test_zero_paper_figure_1(stage, figure_gb):
    model = SeedModel(parameters=7_500_000_000, activation_bytes={"none": 0}, activation_precision=Precision.BF16)
    hardware = HardwareSpec(nodes=8, gpus_per_node=8, gpu_memory_bytes=80 * 2**30)  # N_d = 64
    training = TrainingSpec(global_batch_size=64, micro_batch_size=1, sequence_length=1024)
    candidate = Candidate(zero_stage=stage, offload_optimizer=OffloadDevice.NONE, offload_param=OffloadDevice.NONE,
                          precision=Precision.BF16, checkpointing=NoCheckpointing(), micro_batch_size=1)
    per_gpu = compute_ledger(candidate=candidate, model=model, hardware=hardware, training=training).per_gpu()
    states = per_gpu["params"] + per_gpu["grads"] + per_gpu["master_weights"] + per_gpu["optimizer"]
    assert states / GB == pytest.approx(figure_gb, abs=0.05)  # the figure's one decimal


def test_the_estimators_are_the_ones_references_quotes():
    # docs/sources.md, run here for 1e9 parameters on 2 GPUs (GiB): ZeRO-2 10.24 (offload: 1.86 GPU, 22.35 CPU);
    # ZeRO-3 with a 5e7-parameter largest layer: 8.57 / 1.12 / 0.19. A changed estimator fails here first.
    cpu, gpu = estimate_zero2_model_states_mem_needs(10**9, 2, 1, cpu_offload=True)
    assert (round(gpu / GIB, 2), round(cpu / GIB, 2)) == (1.86, 22.35)
    assert round(estimate_zero2_model_states_mem_needs(10**9, 2, 1, cpu_offload=False)[1] / GIB, 2) == 10.24
    zero3 = [estimate_zero3_model_states_mem_needs(10**9, 5 * 10**7, 2, 1, cpu_offload=opt, cpu_offload_params=par)[1]
             for opt, par in ((False, False), (True, False), (True, True))]
    assert [round(g / GIB, 2) for g in zero3] == [8.57, 1.12, 0.19]


def _zero2(**kw):
    return estimate_zero2_model_states_mem_needs(PSI, N, 1, **kw)


def _zero3(**kw):
    return estimate_zero3_model_states_mem_needs(PSI, LARGEST_TENSOR, N, 1, **kw)[1]


def test_zero2_items_are_the_estimators_terms():
    params16 = _zero2(cpu_offload=True)[1]  # 2Ψ
    partitioned = _zero2(cpu_offload=False)[1] - params16  # 18Ψ/N
    partition = partitioned // 18  # Ψ/N elements
    assert partition == 328_930_816  # P, below
    led = ledger(ZeroStage.GRADIENTS)
    assert item(led, "bf16 parameters (flat, full)") == params16
    # 4 (fp32 params) + 8 (Adam) + 2 (16-bit grads) + 4 (fp32 grads) per element of the partition: the
    # master partition, the Adam states, and in step the flattened 16-bit gradients with their fp32 copy.
    assert item(led, "fp32 master partition") + item(led, "Adam exp_avg") \
        + item(led, "flat + fp32 gradient partition in step") == partitioned
    # Left out by the estimator: grads_in_partition, held in step together with its flat copy
    # (stage_1_and_2.py:3117-3119). It holds the tensors the worst rank owns, in full (stage_1_and_2.py:2184-2194,
    # 2596-2600). By hand: P = 328,930,816, block k starts at 107,120,640 + 50,358,272·k (after the embeddings),
    # its fc weight at +16,793,600 and its proj weight at +33,579,008 (16,777,216 each). Rank 1 starts inside block
    # 4's fc weight [325,347,328, 342,124,544), rank 2 inside block 10's proj weight [644,282,368, 661,059,584),
    # rank 3 inside block 17's fc weight [980,004,864, 996,782,080): rank 0 owns 342,124,544 elements, rank 1
    # 661,059,584 − 325,347,328 = 335,712,256, rank 2 996,782,080 − 644,282,368 = 352,499,712, rank 3
    # Ψ − 980,004,864 = 335,718,400. (The old bound P + 2·Lₜ said 534,783,488.)
    held = item(led, "bf16 gradient partition (until step)")
    assert held == 2 * 352_499_712
    assert gpu_states(led, Phase.STEP) == params16 + partitioned + held


def test_zero2_cpu_offload_splits_as_the_estimator_does():
    led = ledger(ZeroStage.GRADIENTS, optimizer=OffloadDevice.CPU)
    assert gpu_states(led, Phase.BACKWARD) == _zero2(cpu_offload=True)[1]  # 2Ψ: the 16-bit parameters only
    # Host, whole node: Ψ·max(4N, 16) = 16Ψ at N = 4 (the estimator's CPU figure without its 1.5 buffer factor):
    # fp32 master + fp32 gradients + Adam, N partitions of them.
    host = N * (item(led, "fp32 master partition", Location.HOST) + item(led, "Adam exp_avg", Location.HOST)
                + item(led, "fp32 gradient partition (pinned)", Location.HOST))
    assert host == _zero2(cpu_offload=True, additional_buffer_factor=1)[0]


def test_zero3_items_are_the_estimators_terms():
    gather = _zero3(cpu_offload=True, cpu_offload_params=True)  # 4·LL: 16-bit params + grads of the largest
    partition16 = _zero3(cpu_offload=True, cpu_offload_params=False) - gather  # 2Ψ/N
    partitioned = _zero3(cpu_offload=False, cpu_offload_params=False) - gather  # 18Ψ/N
    led = ledger(ZeroStage.PARAMETERS)
    assert item(led, "gathered largest module") == gather
    assert item(led, "bf16 parameter partition") == partition16
    assert item(led, "fp32 master partition") + item(led, "Adam exp_avg") \
        + item(led, "flat + fp32 gradient sub-group in step") == partitioned
    # Left out by the estimator's 18: the persistent 16-bit gradient partition (stage3.py:791-796), 2Ψ/N too.
    assert item(led, "bf16 gradient partition") == partition16
    # Persistent (never partitioned) tensors, counted by hand: every bias and LayerNorm tensor is at most
    # 8,192 elements, under the threshold 10·h = 20,480; every matrix is over 4 million. Per layer
    # q/k/v/o biases 4·2048 + fc bias 8192 + proj bias 2048 + two LayerNorms 2·2·2048 = 26,624 elements;
    # × 24 + the final LayerNorm 4,096 = 643,072 elements, 2 bytes each in bf16.
    assert item(led, "persistent parameters") == 643_072 * 2


def test_zero3_optimizer_offload_leaves_the_estimators_gpu_side():
    led = ledger(ZeroStage.PARAMETERS, optimizer=OffloadDevice.CPU)
    estimator = _zero3(cpu_offload=True, cpu_offload_params=False)  # 4·LL + 2Ψ/N
    assert item(led, "bf16 parameter partition") + item(led, "gathered largest module") == estimator


def test_zero3_full_offload_leaves_only_the_gather_on_gpu():
    led = ledger(ZeroStage.PARAMETERS, optimizer=OffloadDevice.CPU, param=OffloadDevice.CPU)
    assert item(led, "gathered largest module") == _zero3(cpu_offload=True, cpu_offload_params=True)  # 4·LL
    # 2Q on the host, Q = Ψ/N = 328,930,816 elements (Ψ divides by N = 4: no padding), 2 bytes each
    assert item(led, "bf16 parameter partition", Location.HOST) == 2 * 328_930_816 == 2 * PSI // N
    assert not [i for i in led.items if i.name.startswith("bf16 parameter partition") and i.location is Location.GPU
                and i.phase is not Phase.INIT]


def test_zero3_on_one_rank_gathers_views_of_the_partition_not_copies():
    # partition_parameters.py:1559-1560: every partition of world size 1 takes _no_gather_coalesced, whose
    # NoGatherHandle (:61-75) sets param.data to the device partition itself. The module's full gradient stays:
    # 2 bytes × the token embedding's 102,926,336 elements = 205,852,672 B. Measured: gpu_check's dry run row
    # gpt ×1 z3 bf16 read 4.10 MB; the ledger said 4.47 MB with a gathered copy, 4.14 MB without.
    one = HardwareSpec(gpus_per_node=1, gpu_memory_bytes=80 * 2**30)
    led = ledger(ZeroStage.PARAMETERS, hardware=one)
    assert item(led, "parameters gathered (one rank") == 0
    assert item(led, "full gradient of the module at hand") == 205_852_672
    offloaded = ledger(ZeroStage.PARAMETERS, optimizer=OffloadDevice.CPU, param=OffloadDevice.CPU, hardware=one)
    assert item(offloaded, "gathered largest module") == 4 * 102_926_336  # .to(device) copies from the host


@pytest.mark.parametrize("stage", [ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS, ZeroStage.PARAMETERS])
def test_fp32_training_still_keeps_a_separate_fp32_master_partition(stage):
    # stage_1_and_2.py:560 clones the partition; stage3.py:1162-1167's alias never fires (measured on real
    # DeepSpeed: tests/real/deepspeed/test_model_states_real.py, master_is_a_copy). Ψ/N = 328,930,816 fp32 elements.
    led = ledger(stage, precision=Precision.FP32)
    assert led.per_gpu()["master_weights"] == 328_930_816 * 4


def test_a_tensor_across_several_ranks_belongs_to_each_of_them():
    # 1 block, h = 64, ffn 256, vocab 4096, 1024 learned positions, on N = 8: embedding 4096·64 = 262,144, positions
    # 65,536, the block 49,984 (as in test_zero12_phases.py), final norm 128: Ψ = 377,792 = 16·23,612, P = 47,224.
    # The embedding [0, 262,144) starts in rank 0 and crosses the starts of ranks 1-5 (5·P = 236,120); the positions
    # start in rank 5's range at 262,144: rank 5 owns 262,144 + 65,536 = 327,680, the worst (rank 6: the positions,
    # norm1 and q's weight, 69,760; rank 7: 49,984). Its largest piece is a whole range, P.
    small = TransformerModel(layers=1, hidden_size=64, heads=4, kv_heads=4, ffn_size=256, vocab_size=4096,
                             max_positions=1024)
    assert parameter_count(small) == 377_792
    assert zero12_partition(small, ranks=8) == FlatPartition(padded=377_792, held=327_680, largest_piece=47_224,
                                                             ranks=8)
    assert zero12_partition(small, ranks=8).per_rank == 47_224
    # MODEL at N = 4: Σ worked in test_zero2_items_are_the_estimators_terms; the embedding lies inside rank 0.
    flat = zero12_partition(MODEL, ranks=4)
    assert (flat.held, flat.largest_piece, flat.padded % 8) == (352_499_712, LARGEST_TENSOR, 0)


@pytest.mark.parametrize(("stage", "phase"),
                         [(ZeroStage.OPTIMIZER, Phase.REDUCE), (ZeroStage.GRADIENTS, Phase.BACKWARD)])
def test_zero12_offload_takes_the_norm_of_each_piece_at_the_boundary(stage, phase):
    # stage_1_and_2.py:1886, from copy_grads_in_partition (:2161-2176): fp64 of the rank's piece of one parameter,
    # at most the embedding (Lₚ = Lₜ = 102,926,336): 823,410,688 bytes; stage 1 reduces after backward. The step
    # sums the stored norms and updates on the host: no device item (the old 12·Lₜ in step is gone).
    led = ledger(stage, optimizer=OffloadDevice.CPU)
    found = [i for i in led.items if i.name.startswith("fp64 norm of one parameter's piece")]
    assert [(i.bytes, i.location, i.phase) for i in found] == [(823_410_688, Location.GPU, phase)]
    assert not [i for i in led.items if i.phase is Phase.STEP and i.location is Location.GPU]


@pytest.mark.parametrize(("optimizer", "list_bytes"), [(OffloadDevice.CPU, 0), (OffloadDevice.NVME, 102_926_336)])
def test_zero3_offload_takes_the_norm_of_one_partition_at_a_time_in_backward(optimizer, list_bytes):
    # The embedding's partition x = 102,926,336 / 4 = 25,731,584 elements: its bf16 device copy (2x) and fp64 norm
    # (8x) together, 257,315,840 bytes (stage3.py:2028, 1446); its fp32 copy (4x) comes after the fp64 is freed.
    # With NVMe the fp32 copies of one reduction are kept for the swap-out: the embedding alone (larger than the
    # bucket, 2048² = 4,194,304), 4x = 102,926,336 bytes. No host fp64 item in the step (stage3.py:1975-2004).
    led = ledger(ZeroStage.PARAMETERS, optimizer=optimizer,
                 hardware=HardwareSpec(gpus_per_node=N, gpu_memory_bytes=80 * 2**30, nvme_path="/nvme"))
    norm = [i for i in led.items if i.name.startswith("one parameter's gradient partition at the boundary")]
    assert [(i.bytes, i.location, i.phase) for i in norm] == [(257_315_840, Location.GPU, Phase.BACKWARD)]
    kept = [i.bytes for i in led.items if i.name.startswith("fp32 gradient copies of one reduction")]
    assert sum(kept) == list_bytes
    assert not [i for i in led.items if "grad-norm" in i.name or "per-bucket" in i.name]


def test_zero3_offload_norm_in_chunks_and_on_cpu_ranks():
    # A 250,000 × 8192 embedding (2,048,000,000 elements) on N = 4: x = 512,000,000 > the 2.5e8-element fp64
    # chunk (stage3.py:1960-1967), so the fp64 part is 8·2.5e8 = 2,000,000,000 bytes and the fp32 copy after it,
    # 4x = 2,048,000,000, is larger. bf16 on a GPU: 2x + 4x = 3,072,000,000; fp32 (no cast): 4x + 2e9 =
    # 4,048,000,000. On CPU ranks the device copy is the host partition itself: 2,048,000,000 in bf16.
    wide = TransformerModel(layers=1, hidden_size=8192, heads=64, kv_heads=64, ffn_size=32768, vocab_size=250_000,
                            max_positions=128)
    cpu = HardwareSpec(accelerator=Accelerator.CPU, gpus_per_node=N, gpu_memory_bytes=80 * 2**30,
                       supported_precisions=(Precision.FP32, Precision.BF16))

    def norm(precision, hardware=HARDWARE):
        led = ledger(ZeroStage.PARAMETERS, optimizer=OffloadDevice.CPU, precision=precision, model=wide,
                     hardware=hardware)
        return item(led, "one parameter's gradient partition at the boundary")
    assert [norm(Precision.BF16), norm(Precision.FP32), norm(Precision.BF16, cpu)] == [
        3_072_000_000, 4_048_000_000, 2_048_000_000]


def test_zero0_on_gloo_prices_the_late_allreduce_flatten_as_risk():
    # Two dry runs of the same 2-CPU-rank candidate (gpu_check gpt ×2 z0 bf16) measured 3.94 and 4.27 MB: 2Ψ apart,
    # the flattened allreduce buffer gloo's thread let go of after the step's allocations began — in one run, not
    # the other. On CUDA ranks the item is absent; on CPU ranks it is a risk (in no figure of the need): the
    # flatten in the step phase, one chunk of 5e8 elements + the token embedding that crosses its end
    # (engine.py:151, 3073-3095), 2 × 602,926,336 B. Here it adds nothing to the peak: the step with it, 31.58 +
    # 1.21 GB, stays under backward's 32.96 GB (cpu-tiny, whose step is its peak, prices all of it:
    # tests/optimizer/search/test_launch_margin.py).
    cpu = HardwareSpec(gpus_per_node=N, gpu_memory_bytes=80 * 2**30, accelerator=Accelerator.CPU)
    on_cpu, on_cuda = ledger(ZeroStage.DISABLED, hardware=cpu), ledger(ZeroStage.DISABLED)
    assert [(i.name, i.bytes, i.phase) for i in on_cpu.risks] == [
        ("allreduce flatten, freed late on gloo's thread", 1_205_852_672, Phase.STEP)]
    totals = on_cpu.phase_totals()
    assert (totals["step"], totals["backward"]) == (31_577_358_336, 32_959_864_832)
    assert on_cpu.peak_phase is Phase.BACKWARD and on_cpu.risk_bytes == 0
    assert on_cpu.training_bytes_at(Location.GPU) == on_cuda.training_bytes_at(Location.GPU)
    assert on_cuda.risks == () and on_cuda.risk_bytes == 0
