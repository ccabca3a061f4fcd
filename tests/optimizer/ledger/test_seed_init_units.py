"""Whole outputs of four ledger functions on small inputs, every row worked by hand:

* ``seed_items`` (optimizer/ledger/seed.py): the seed's rules as its module docstring states them — parameters and
  gradients g·Ψ, Adam's two FP32 states 8Ψ, the FP32 master 4Ψ in mixed precision (ZeRO paper §3), ZeRO dividing
  each by N from stage 3 / 2 / 1 (``2Ψ/N``), the stated activations scaled linearly in b and by element bytes;
* ``init_moments`` (optimizer/ledger/init_phase.py): every moment of its module docstring, with the DeepSpeed 0.19.8
  file:line each line cites (optimizer/deepspeed/versions.py pins 0.19.8);
* ``activation_items`` (optimizer/ledger/activations.py): the traced lines (a traced point, or the line through the
  two nearest, TracedActivation's docstring) and the formula's lines with the reason a trace was not used;
* ``activation_estimate`` (optimizer/ledger/transformer.py): Korthikanti et al. 2022 §4.1 terms per granularity.

Names, formulas and sources are the rows the ledger table prints (optimizer/results/report.py), so they are
checked literally; the DeepSpeed swap defaults (5 buffers of 1e8 elements, max_in_cpu 1e9) are DeepSpeed's
``offload_param`` defaults as optimizer/deepspeed/zero_settings.py documents them.
"""

from __future__ import annotations

import re

import pytest

from optimizer.ledger.activations import activation_items
from optimizer.ledger.init_phase import init_moments
from optimizer.ledger.items import Category, Location, Phase
from optimizer.ledger.seed import seed_items
from optimizer.ledger.transformer import activation_estimate
from optimizer.study.knobs import Candidate, OffloadDevice, Precision, ZeroStage, parse_checkpointing
from optimizer.study.specs import (
    ActivationSource,
    Construction,
    HardwareSpec,
    SeedModel,
    TrainingSpec,
    TransformerModel,
)
from optimizer.study.traced_activation import TracedActivation

P, G, OPT, M, A, B = (Category.PARAMS, Category.GRADS, Category.OPTIMIZER, Category.MASTER_WEIGHTS,
                    Category.ACTIVATIONS, Category.BUFFERS)
GPU, HOST, NVME = Location.GPU, Location.HOST, Location.NVME
SEED = "seed document (Q130), table '先把单卡 26 GB 的账算出来'"
ZERO = "ZeRO (Rajbhandari et al. 2020) §3, mixed-precision Adam 16Ψ"
STATED = f"study: the stated figure ({SEED}); linear in b (Korthikanti et al. 2022 §4.1)"
DS = "DeepSpeed 0.19.8"
S12 = f"{DS} runtime/zero/stage_1_and_2.py"
S3 = f"{DS} runtime/zero/stage3.py"
KORTHIKANTI = "Korthikanti et al. 2022 §4 (arXiv 2205.05198)"


def _candidate(stage: int, precision: str, *, mbs: int = 4, ckpt: str = "none", opt: str = "none",
               param: str = "none") -> Candidate:
    return Candidate(zero_stage=ZeroStage(stage), precision=Precision(precision), micro_batch_size=mbs,
                     checkpointing=parse_checkpointing(ckpt), offload_optimizer=OffloadDevice(opt),
                     offload_param=OffloadDevice(param))


def _rows(items):
    return [(i.name, i.category, i.location, i.bytes, i.formula, i.source, i.phase) for i in items]


# --- seed.py ---------------------------------------------------------------------------------------------------
# Ψ = 1001 (odd, so the /N shares floor), stated activations at the baseline micro-batch 4 in fp32, buffers 500.
SEED_MODEL = SeedModel(parameters=1001, activation_bytes={"none": 8000, "full": 3001}, buffer_bytes=500)
SEED_TRAINING = TrainingSpec(global_batch_size=16, micro_batch_size=4, sequence_length=8)


def _seed(candidate: Candidate, ranks: int):
    hardware = HardwareSpec(gpus_per_node=ranks, gpu_memory_bytes=10**9)
    return _rows(seed_items(candidate=candidate, model=SEED_MODEL, hardware=hardware, training=SEED_TRAINING))


def test_seed_bf16_zero3_offloaded_every_row():
    rows = _seed(_candidate(3, "bf16", mbs=2, ckpt="full", opt="cpu", param="cpu"), ranks=4)
    assert rows == [
        ("bf16 parameters", P, HOST, 500, "2Ψ/N", ZERO, Phase.ALWAYS),  # 2·1001 = 2002, //4 = 500
        ("bf16 gradients", G, GPU, 500, "2Ψ/N", ZERO, Phase.ALWAYS),
        ("Adam exp_avg + exp_avg_sq (fp32)", OPT, HOST, 2002, "8Ψ/N", ZERO, Phase.ALWAYS),  # 8008 // 4
        ("fp32 master weights", M, HOST, 1001, "4Ψ/N", ZERO, Phase.ALWAYS),  # 4004 // 4
        # 3001 stated at b = 4 in 4-byte elements; at b = 2 in 2 bytes: 3001·2·2 // (4·4) = 12004 // 16 = 750
        ("activations (full)", A, GPU, 750, "stated[full] × 2/4 (micro-batch) × 2/4 (element bytes)", STATED,
         Phase.BACKWARD),
        ("working buffers (stated)", B, GPU, 500, "stated", SEED, Phase.ALWAYS),
    ]


def test_seed_fp32_plain_data_parallel_every_row():
    rows = _seed(_candidate(0, "fp32"), ranks=2)
    assert rows == [
        ("fp32 parameters", P, GPU, 4004, "4Ψ", SEED, Phase.ALWAYS),  # 4·1001, not partitioned
        ("fp32 gradients", G, GPU, 4004, "4Ψ", SEED, Phase.ALWAYS),
        ("Adam exp_avg + exp_avg_sq (fp32)", OPT, GPU, 8008, "8Ψ", SEED, Phase.ALWAYS),
        ("activations (none)", A, GPU, 8000, "stated[none]", STATED, Phase.BACKWARD),  # same b, same bytes
        ("working buffers (stated)", B, GPU, 500, "stated", SEED, Phase.ALWAYS),
    ]


@pytest.mark.parametrize(("stage", "params", "grads", "states"), [
    (1, (4004, "4Ψ"), (4004, "4Ψ"), (4004, "8Ψ/N")),  # stage 1: the states, 8008 // 2
    (2, (4004, "4Ψ"), (2002, "4Ψ/N"), (4004, "8Ψ/N")),  # stage 2: also the gradients
    (3, (2002, "4Ψ/N"), (2002, "4Ψ/N"), (4004, "8Ψ/N")),  # stage 3: also the parameters
])
def test_seed_fp32_zero_stages_partition_over_n(stage, params, grads, states):
    rows = _seed(_candidate(stage, "fp32", opt="nvme"), ranks=2)
    assert [(r[0], r[2], r[3], r[4]) for r in rows[:3]] == [
        ("fp32 parameters", GPU, *params), ("fp32 gradients", GPU, *grads),
        ("Adam exp_avg + exp_avg_sq (fp32)", NVME, *states)]
    assert len(rows) == 5  # fp32: no master copy


@pytest.mark.parametrize(("precision", "mbs", "activation", "formula"), [
    ("fp32", 8, 16000, "stated[none] × 8/4 (micro-batch)"),  # 8000·8·4 // (4·4)
    ("fp16", 4, 4000, "stated[none] × 2/4 (element bytes)"),  # 8000·4·2 // (4·4)
])
def test_seed_activation_formula_names_only_what_was_scaled(precision, mbs, activation, formula):
    row = _seed(_candidate(0, precision, mbs=mbs), ranks=2)[-2]
    assert row[:5] == ("activations (none)", A, GPU, activation, formula)


def test_seed_without_a_stated_figure_for_the_granularity_says_which():
    with pytest.raises(ValueError, match=re.escape("no activation figure for checkpointing=every_2")):
        _seed(_candidate(0, "fp32", ckpt="every_2"), ranks=2)


# --- init_phase.py ---------------------------------------------------------------------------------------------
# Ψ = 1001 on N = 4: Ψ₁₂ = 1001 padded to 2N = 8 → 1008, P = 1008/4 = 252; Lₜ = 100, LL = 150, B = 5000.

def _init(candidate: Candidate, construction: Construction, *, q: int = 252, device_bytes: int | None = None):
    moments = init_moments(candidate=candidate, construction=construction, psi=1001, padded=1008, p=252, q=q,
                           s=100, largest_tensor=100, largest_module=150, bucket=5000, device_bytes=device_bytes)
    assert all(i.phase is Phase.INIT for m in moments for i in m)
    return [[r[:6] for r in _rows(m)] for m in moments]


FP32_MODEL = ("model built in fp32 on the host", P, HOST, 4004, "4Ψ",
              "a script that builds the model whole (training.model_init: full)")


def test_full_construction_at_zero2_with_the_optimizer_offloaded():
    assert _init(_candidate(2, "bf16", opt="cpu"), Construction.FULL) == [
        [FP32_MODEL],
        [FP32_MODEL, ("bf16 copy of one tensor while casting", P, HOST, 200, "2Lₜ",  # 2·100
                      f"{DS} engine.py:1859-1862 (param by param)")],
        [("whole bf16 model moved to the device", P, GPU, 2002, "2Ψ", f"{DS} engine.py:2092-2094")],
        [("bf16 parameters as built", P, GPU, 2002, "2Ψ", f"{S12}:438-460"),  # no device_bytes: room
         ("bf16 flat copy (padded to 2N)", P, GPU, 2016, "2Ψ₁₂", f"{S12}:503-521")],  # 2·1008
        [("bf16 parameters (flat, full)", P, GPU, 2016, "2Ψ₁₂", f"{S12}:505-509"),
         ("fp32 master partition", M, HOST, 1008, "4P", f"{S12}:560"),  # 4·252
         ("zero fp32 gradient partition", G, HOST, 1008, "4P", f"{S12}:934-941"),
         ("bf16 parameter staging partition (pinned)", B, HOST, 504, "2P", f"{S12}:566-575"),
         ("temp gradient buffers for offload", B, GPU, 400, "2·2Lₜ", f"{S12}:653-661")],  # 2·2·100
    ]


DEVICE_BF16 = ("whole model built on the device in bf16", P, GPU, 2002, "2Ψ",
               "training.model_init: device (torch.device + default dtype)")
ZERO1_SETUP = [("bf16 parameters (flat, full)", P, GPU, 2016, "2Ψ₁₂", f"{S12}:505-509"),
               ("fp32 master partition", M, GPU, 1008, "4P", f"{S12}:560"),
               ("zero fp32 gradient partition", G, GPU, 1008, "4P", f"{S12}:934-941")]


def test_zero1_flattens_on_the_device_when_the_flat_copy_just_fits():
    # room: device_bytes − 2Ψ ≥ 2Ψ₁₂, i.e. device_bytes ≥ 2002 + 2016 = 4018
    assert _init(_candidate(1, "bf16"), Construction.DEVICE, device_bytes=4018) == [
        [DEVICE_BF16],
        [("bf16 parameters as built", P, GPU, 2002, "2Ψ", f"{S12}:438-460"),
         ("bf16 flat copy (padded to 2N)", P, GPU, 2016, "2Ψ₁₂", f"{S12}:503-521")],
        ZERO1_SETUP,
    ]


def test_zero1_flattens_on_the_host_one_byte_short_of_room():
    assert _init(_candidate(1, "bf16"), Construction.DEVICE, device_bytes=4017) == [
        [DEVICE_BF16],
        [("bf16 parameters as built, moved to the host", P, HOST, 2002, "2Ψ", f"{S12}:438-460"),
         ("bf16 flat copy (padded to 2N), made on the host", P, HOST, 2016, "2Ψ₁₂", f"{S12}:503-521")],
        ZERO1_SETUP,
    ]


def test_stage0_fp32_full_construction_is_built_then_moved():
    assert _init(_candidate(0, "fp32"), Construction.FULL) == [
        [FP32_MODEL],  # fp32: nothing to cast
        [("whole fp32 model moved to the device", P, GPU, 4004, "4Ψ", f"{DS} engine.py:2092-2094")],
    ]


def test_stage0_bf16_runs_the_initial_step_of_fp16_optimizer():
    fused = f"{DS} runtime/fp16/fused_optimizer.py"
    assert _init(_candidate(0, "bf16"), Construction.DEVICE) == [
        [DEVICE_BF16],
        [("bf16 parameters (flat)", P, GPU, 2002, "2Ψ", f"{fused}:93-98"),
         ("fp32 master weights (flat)", M, GPU, 4004, "4Ψ", f"{fused}:100"),
         ("zero fp32 gradients for the initial step", G, GPU, 4004, "4Ψ", f"{fused}:125-130"),
         ("Adam exp_avg + exp_avg_sq (fp32)", OPT, GPU, 8008, "8Ψ", f"{fused}:130 (optimizer.step())")],
    ]


BUCKET = ("gradient bucket (reduce_bucket_size = 5,000)", B, GPU, 10000, "2·B", f"{S3}:779-784")  # 2·5000
GATHERED = ("largest module gathered", P, GPU, 600, "2·2·LL",  # 2·2·150
            f"{DS} partition_parameters.py (all-gather buffer + gathered)")


def test_zero3_device_built_with_parameters_and_optimizer_on_cpu_on_cuda():
    master = ("fp32 master partition", M, HOST, 1008, "4Q", f"{S3}:1157-1172")  # 4·252
    assert _init(_candidate(3, "bf16", opt="cpu", param="cpu"), Construction.DEVICE, device_bytes=10**9) == [
        [DEVICE_BF16],
        [("whole bf16 model on the device while it is partitioned", P, GPU, 2002, "2Ψ",
          f"{DS} partition_parameters.py:1193-1207 (Init(module=model))"),
         ("bf16 partition of one tensor", P, HOST, 200, "2Lₜ", f"{DS} partition_parameters.py:1836")],
        [("bf16 parameter partition + its flat pinned copy", P, HOST, 1008, "2·2Q",  # 2·2·252
          f"{S3}:975-995, 888-911 (_create_param_groups_fp16_flat_cpu_memory)"),
         master, BUCKET, GATHERED],
        [("bf16 parameter partition (flat, pinned)", P, HOST, 504, "2Q", f"{S3}:888-911"),
         master, BUCKET,
         ("zero fp32 gradient sub-group for optimizer set-up", G, HOST, 400, "4S", f"{S3}:333, 1301-1306"),
         ("fp32 gradient partition (pinned)", G, HOST, 1008, "4Q", f"{S3}:1337-1342"),
         ("one sub-group's zero gradient while it is pinned", B, HOST, 400, "4S",  # CUDA: pinning copies
          f"{S3}:1338-1340; {DS} accelerator/abstract_accelerator.py:335-339")],
    ]


def test_zero3_cpu_offload_on_cpu_ranks_pins_in_place():
    moments = _init(_candidate(3, "bf16", opt="cpu", param="cpu"), Construction.DEVICE, device_bytes=None)
    assert [r[0] for r in moments[-1]] == [
        "bf16 parameter partition (flat, pinned)", "fp32 master partition",
        "gradient bucket (reduce_bucket_size = 5,000)", "zero fp32 gradient sub-group for optimizer set-up",
        "fp32 gradient partition (pinned)"]  # no copy while pinning (cpu_accelerator.py:283-292)


def test_zero3_zero_init_with_nothing_offloaded():
    master = ("fp32 master partition", M, GPU, 1008, "4Q", f"{S3}:1157-1172")
    assert _init(_candidate(3, "bf16"), Construction.ZERO_INIT) == [
        [("bf16 parameter partition, made as modules are built", P, GPU, 504, "2Q",
          f"{DS} partition_parameters.py:1232-1262, 1836"),
         ("largest module whole before partitioning, then gathered to initialise", P, GPU, 600, "2·2·LL",
          f"{DS} partition_parameters.py:1232-1262; GatheredParameters (all-gather buffer + gathered)")],
        [("bf16 parameter partition", P, GPU, 504, "2Q", f"{S3}:967-973"),
         ("bf16 defragmentation buffer (host)", B, HOST, 504, "2Q",
          f"{DS} runtime/zero/utils.py:215-243 (partitions copied to the host, then back)"),
         master, BUCKET, GATHERED],
        [("bf16 parameter partition (flat)", P, GPU, 504, "2Q", f"{S3} _create_fp16_partitions_with_defragmentation"),
         master, BUCKET, ("zero fp32 gradient sub-group for optimizer set-up", G, GPU, 400, "4S",
                          f"{S3}:333, 1301-1306")],
    ]


def test_zero3_zero_init_with_everything_on_nvme():
    # Q = 1.5e9 elements > max_in_cpu = 1e9: the pinned copy holds 1e9 of them, 4 bytes each in fp32
    q = 1_500_000_000
    flat = [("fp32 parameter partition files", P, NVME, 6_000_000_000, "4Q", f"{DS} partition_parameters.py:1816-1824"),
            ("fp32 flat pinned copy (≤ max_in_cpu)", P, HOST, 4_000_000_000, "4·min(Q, max_in_cpu)",
             f"{S3}:888-911"),
            ("parameter swap buffers (buffer_count × buffer_size)", B, HOST, 2_000_000_000, "5·1e8·4",  # 5·1e8·4
             f"{DS} swap_tensor/partitioned_param_swapper.py:104-127")]
    master = ("fp32 master partition", M, HOST, 400, "4S", f"{S3}:1157-1172")  # NVMe optimizer: 4·S = 4·100
    bucket = ("gradient bucket (reduce_bucket_size = 5,000)", B, GPU, 20000, "4·B", f"{S3}:779-784")
    assert _init(_candidate(3, "fp32", opt="nvme", param="nvme"), Construction.ZERO_INIT, q=q) == [
        [("fp32 parameter partition, made as modules are built", P, NVME, 6_000_000_000, "4Q",
          f"{DS} partition_parameters.py:1232-1262, 1836"),
         ("largest module whole before partitioning, then gathered to initialise", P, GPU, 1200, "2·4·LL",
          f"{DS} partition_parameters.py:1232-1262; GatheredParameters (all-gather buffer + gathered)")],
        [*flat, master, bucket,
         ("largest module gathered", P, GPU, 1200, "2·4·LL",  # 2·4·150
          f"{DS} partition_parameters.py (all-gather buffer + gathered)")],
        [*flat, master, bucket, ("zero fp32 gradient sub-group for optimizer set-up", G, HOST, 400, "4S",
                                 f"{S3}:333, 1301-1306")],
    ]


# --- activations.py and transformer.py ---------------------------------------------------------------------------
# A GPT-2 shape (dropout, eager attention, GELU): L = 2, h = 8, a = 2 (d = 4), one KV head (kv·d = 4), f = 32, V = 16;
# at s = 4, b = 1, p = 2: sbh = 32. Per block: norm inputs 2·2·32 = 128, QKV input 64, Q and K 64 + 2·4·4 = 96, V 32,
# out-proj input 64, core (softmax 2·2·16 = 64, its mask 32, dropout output 64) 160, attention mask 32, MLP input 64,
# GELU 2·2·4·32 = 512, MLP mask 32: layer = 1184. Head: mask 32 + final norm 64 + LM-head input 64 + logits
# 4·4·16 = 256 = 416. Boundary p·sbh = 64.
TINY = TransformerModel(layers=2, hidden_size=8, heads=2, kv_heads=1, ffn_size=32, vocab_size=16, max_positions=4)


@pytest.mark.parametrize(("ckpt", "stored", "recompute", "formula"), [
    ("none", 2784, 0, "L·layer + head"),  # 2·1184 + 416
    ("full", 544, 1184, "L·p·sbh + head, + 1 recomputed layer"),  # 2·64 + 416
    ("every_2", 1664, 1184, "1·p·sbh + 1·layer + head, + 1 recomputed layer"),  # 64 + 1184 + 416
    ("every_3", 2784, 0, "0·p·sbh + 2·layer + head, + 1 recomputed layer"),  # ⌊2/3⌋ = 0 blocks recomputed
    ("selective", 2464, 160, "L·(layer − attention core) + head, + 1 recomputed core"),  # 2·(1184 − 160) + 416
])
def test_activation_estimate_per_granularity(ckpt, stored, recompute, formula):
    est = activation_estimate(TINY, checkpointing=parse_checkpointing(ckpt), seq=4, micro_batch=1, element_bytes=2)
    assert (est.stored_bytes, est.recompute_bytes, est.formula, est.total_bytes) == (
        stored, recompute, formula, stored + recompute)


def _traced(**fields) -> TransformerModel:
    traced = TracedActivation(checkpointing="full", precision=Precision.BF16, **fields)
    return TransformerModel(layers=2, hidden_size=8, heads=2, kv_heads=1, ffn_size=32, vocab_size=16, max_positions=4,
                            activations=ActivationSource.TRACE, traced_activations=(traced,))


def _act(model: TransformerModel, mbs: int, **flags):
    items = activation_items(model=model, candidate=_candidate(0, "bf16", mbs=mbs, ckpt="full"), sequence_length=4,
                             element_bytes=2, **flags)
    return [r[:5] + r[6:] for r in _rows(items)], {i.source for i in items}


TRACE_SOURCE = "trace: the study's model on fake tensors (bf16); experts counted once"


def test_a_traced_micro_batch_is_read_off_the_trace():
    model = _traced(points=((1, 1000), (4, 2500)), peak_phase="forward", notes=("experts counted once",))
    rows, sources = _act(model, 4)
    assert rows == [("activations, traced high-water mark (full, forward)", A, GPU, 2500, "traced at b = 4",
                     Phase.BACKWARD)]
    assert sources == {TRACE_SOURCE}


def test_an_untraced_micro_batch_is_joined_from_the_traced_ones():
    model = _traced(points=((1, 1000), (4, 2500)), peak_phase="forward", notes=("experts counted once",))
    rows, sources = _act(model, 2)
    # the line through (1, 1000) and (4, 2500) at b = 2: 1000 + 1500·1/3 = 1500
    assert rows == [("activations, traced high-water mark (full, forward)", A, GPU, 1500,
                     "joined from traces at b = 1, 4", Phase.BACKWARD)]
    assert sources == {TRACE_SOURCE}


def test_split_trace_gives_the_activations_before_and_after_the_first_gradient():
    model = _traced(points=((1, 1000), (4, 2500)), split_points=((1, 300, 700), (4, 900, 2200)),
                    notes=("experts counted once",))
    rows, _ = _act(model, 2, split=True)
    # at b = 2: 300 + 600/3 = 500 before, 700 + 1500/3 = 1200 after
    assert rows == [
        ("activations before the first gradient (full)", A, GPU, 500, "joined from traces at b = 1, 4", Phase.FORWARD),
        ("activations once gradients exist (full)", A, GPU, 1200, "joined from traces at b = 1, 4", Phase.BACKWARD)]


def test_a_failed_trace_falls_back_to_the_formula_and_names_the_op():
    model = _traced(failed_op="aten::nonzero")
    rows, sources = _act(model, 1)
    # full checkpointing at b = 1 (the estimate above): 544 kept, 1184 recomputed
    assert rows == [("activations kept for backward (full)", A, GPU, 544, "L·p·sbh + head", Phase.BACKWARD),
                    ("recomputed block in backward", A, GPU, 1184, "1 recomputed layer", Phase.BACKWARD)]
    assert sources == {f"formula (trace failed at aten::nonzero): {KORTHIKANTI}"}


def test_the_formula_lines_for_selective_recompute():
    items = activation_items(model=TINY, candidate=_candidate(0, "bf16", mbs=1, ckpt="selective"), sequence_length=4,
                             element_bytes=2)
    assert _rows(items) == [
        ("activations kept for backward (selective)", A, GPU, 2464, "L·(layer − attention core) + head",
         f"formula: {KORTHIKANTI}", Phase.BACKWARD),
        ("recomputed block in backward", A, GPU, 160, "1 recomputed core", f"formula: {KORTHIKANTI}", Phase.BACKWARD)]
