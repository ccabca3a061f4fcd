"""The gradient norm with the optimizer on the host, and ZeRO-1/2's gradient partition Σ, against real DeepSpeed on
2 CPU ranks (one ``torchrun`` launch, tests/real/deepspeed/offload_norms_rank.py; ~40 s).

The built-in GPT (2 layers, h = 64, ffn 256, vocab 256, 32 learned positions, tied head), worked by hand:
embedding 256·64 = 16,384 (the largest tensor Lₜ), positions 32·64 = 2,048, per block 2·64 (norm1) +
4·(64² + 64) (q, k, v, o) + 2·64 (norm2) + 64·256 + 256 (fc) + 256·64 + 64 (proj) = 49,984, final norm 128:
Ψ = 118,528, a multiple of 2N = 4, so P = 59,264. Block 0 starts at 18,432 and its proj weight spans
[51,968, 68,352), across rank 1's start 59,264: rank 0 owns [0, 68,352) → 68,352 elements, rank 1
[51,968, 118,528) → 66,560 (stage_1_and_2.py:2596-2600). Σ = 68,352; the old P + Lₜ said 75,648.
The largest piece of one tensor inside one rank's range is the embedding, Lₚ = 16,384 (the proj weight is cut
into 7,296 + 9,088). ZeRO-3's partition of the embedding is ⌈16,384/2⌉ = 8,192 elements; reduce_bucket_size
B = h² = 4,096; Q = Ψ/2 = 59,264 (every tensor is even).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from two_ranks import TINY_MODEL, TWO_CPU_RANKS, run_two_ranks

from launchers.trial.run import model_dict
from optimizer.deepspeed.config import build_ds_config
from optimizer.ledger.core import compute_ledger
from optimizer.ledger.items import Location, Phase
from optimizer.ledger.transformer import parameter_count
from optimizer.study.knobs import Candidate, NoCheckpointing, OffloadDevice, Precision, ZeroStage
from optimizer.study.specs import TrainingSpec

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
MODEL = TINY_MODEL
HARDWARE = TWO_CPU_RANKS
SIGMA_PER_RANK = [68_352, 66_560]
PIECE = 16_384
ZERO3_PARTITION = 8_192
SCALAR = 64  # the fp64 norm DeepSpeed keeps per parameter, allocated while its fp64 copy is live (8 B measured)
CASES = {  # name: (stage, precision, optimizer offload, gradient accumulation steps)
    "z3-bf16-cpu": (ZeroStage.PARAMETERS, Precision.BF16, OffloadDevice.CPU, 1),
    "z2-bf16-cpu-gas2": (ZeroStage.GRADIENTS, Precision.BF16, OffloadDevice.CPU, 2),
    "z1-bf16-cpu": (ZeroStage.OPTIMIZER, Precision.BF16, OffloadDevice.CPU, 1),
    "z2-fp32": (ZeroStage.GRADIENTS, Precision.FP32, OffloadDevice.NONE, 1),
    "z1-bf16": (ZeroStage.OPTIMIZER, Precision.BF16, OffloadDevice.NONE, 1),
}


def _candidate(name: str) -> Candidate:
    stage, precision, offload, _ = CASES[name]
    return Candidate(zero_stage=stage, offload_optimizer=offload, offload_param=OffloadDevice.NONE,
                     precision=precision, checkpointing=NoCheckpointing(), micro_batch_size=2)


def _training(name: str) -> TrainingSpec:
    return TrainingSpec(global_batch_size=4 * CASES[name][3], micro_batch_size=2, sequence_length=32)


def _ledger(name: str):
    return compute_ledger(candidate=_candidate(name), model=MODEL, hardware=HARDWARE, training=_training(name))


def _item(led, prefix: str):
    found = [i for i in led.items if i.name.startswith(prefix) and i.phase is not Phase.INIT]
    assert len(found) == 1, [i.name for i in led.items]
    return found[0]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[dict]]:
    work = tmp_path_factory.mktemp("offload_norms")
    cases = [{"name": name, "model": model_dict(MODEL), "seq": 32,
              "config": build_ds_config(candidate=_candidate(name), model=MODEL, hardware=HARDWARE,
                                        training=_training(name))} for name in CASES]
    assert [c["config"]["gradient_accumulation_steps"] for c in cases] == [CASES[n][3] for n in CASES]
    (work / "cases.json").write_text(json.dumps(cases))
    run_two_ranks(HERE / "offload_norms_rank.py", str(work / "cases.json"), str(work))
    return {name: [json.loads((work / f"{name}.rank{r}.json").read_text()) for r in range(2)] for name in CASES}


def test_the_hand_count():
    assert parameter_count(MODEL) == 118_528


def test_zero3_offload_norms_each_partition_in_backward_on_the_device(measured):
    ranks = measured["z3-bf16-cpu"]
    assert all(r["norm_calls"]["step"] == 0 and r["norm_calls"]["backward"] > 0 for r in ranks)
    led = _ledger("z3-bf16-cpu")
    item = _item(led, "one parameter's gradient partition at the boundary")
    # CPU ranks: the "device copy" of the host partition is the partition itself (stage3.py:2028), so the
    # transient is the fp64 copy of the largest partition; its fp32 copy (4 B each) comes after it is freed.
    assert (item.bytes, item.location, item.phase) == (8 * ZERO3_PARTITION, Location.GPU, Phase.BACKWARD)
    peak = max(r["norm_transient"] for r in ranks)
    assert 0 <= peak - item.bytes < SCALAR
    assert peak > (2 + 4) * 4_096 // 2  # the old "(g+4)·B/N" per-bucket item: 12,288 B
    # The old host item "fp64 grad-norm chunks" 8·min(Q, 2.5e8) = 474,112 B in the step is gone: the step allocates
    # only about the persistent parameters' all-gather (stage3.py:2840-2841; 1,792 bf16 elements here).
    assert not [i for i in led.items if "grad-norm" in i.name]
    assert max(r["step_transient"] for r in ranks) < 8 * 1024 < 8 * 59_264


@pytest.mark.parametrize("name", ["z2-bf16-cpu-gas2", "z1-bf16-cpu"])
def test_zero12_offload_norms_each_piece_at_the_boundary_not_in_the_step(measured, name):
    ranks = measured[name]
    assert all(r["norm_calls"]["step"] == 0 for r in ranks)
    assert [r["norm_calls"]["backward"] for r in ranks] == [17, 20]  # the tensors each rank owns
    led = _ledger(name)
    item = _item(led, "fp64 norm of one parameter's piece")
    phase = Phase.BACKWARD if CASES[name][0] is ZeroStage.GRADIENTS else Phase.REDUCE
    assert (item.bytes, item.phase) == (8 * PIECE, phase)
    assert 0 <= max(r["norm_transient"] for r in ranks) - item.bytes < SCALAR
    # The old "per-tensor fp32/fp64 temporaries in step" 12·Lₜ = 196,608 B: the step allocates tens of bytes.
    assert not [i for i in led.items if i.phase is Phase.STEP and i.location is Location.GPU]
    assert max(r["step_transient"] for r in ranks) < 1024


@pytest.mark.parametrize("name", ["z2-fp32", "z1-bf16"])
def test_grads_in_partition_is_what_the_worst_rank_owns(measured, name):
    assert [r["grads_in_partition"] for r in measured[name]] == SIGMA_PER_RANK
    g = CASES[name][1].bytes_per_element
    assert _item(_ledger(name), f"{CASES[name][1]} gradient partition (grads_in_partition").bytes == g * 68_352


def test_zero2_offload_accumulates_what_the_worst_rank_owns(measured):
    assert [r["accumulated_grads_in_cpu"] for r in measured["z2-bf16-cpu-gas2"]] == SIGMA_PER_RANK
    assert _item(_ledger("z2-bf16-cpu-gas2"), "accumulated gradients on host").bytes == 2 * 68_352
