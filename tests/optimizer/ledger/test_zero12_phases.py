"""When ZeRO-1/2's buffers are live, against the moments a profiled real run showed (benchmarks/
peak_attribution.py on grid-cpu): ZeRO-2's bucket and gradient partition appear at the first gradient's hook,
so the activations' high-water mark before it (the start of backward) meets no gradient storage; the
partition the earlier micro-batches filled is there when the next one starts; stage 1 accumulates nothing on
the host; on CPU ranks gloo's all-gather after the step allocates the gathered parameters.

Every figure below is worked by hand for grid-cpu's model (2 layers, h = 64, 4 heads, vocab 256, tied head,
learned positions of 64): Ψ = 2 · (4·(64² + 64) + 2·2·64 + 64·256 + 256 + 256·64 + 64) + 256·64 + 64·64 + 2·64
= 120,576 on 2 ranks, P = Ψ/2 = 60,288, the largest tensor Lₜ = 64·256 = 16,384 elements, the bucket
B = 64² = 4,096 elements; fp32 (4 bytes). The gradient partition Σ is what the worst rank owns in full: block 0
(49,984 elements: 2·64 + 4·(64² + 64) + 2·64 + 64·256 + 256 + 256·64 + 64) starts after the embeddings at
16,384 + 4,096 = 20,480, and its proj weight spans [54,016, 70,400), across rank 1's start P = 60,288 — rank 0
owns [0, 70,400), rank 1 [54,016, 120,576) = 66,560: Σ = 70,400 elements (stage_1_and_2.py:2596-2600).
The traced activations are stated (not traced): the rule, not the trace, is under test here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from optimizer.ledger.core import compute_ledger
from optimizer.ledger.items import Location, Phase
from optimizer.ledger.transformer import parameter_count
from optimizer.study.knobs import Precision, with_knobs
from optimizer.study.specs import ActivationSource, baseline_candidate
from optimizer.study.study_file import load_study
from optimizer.study.traced_activation import TracedActivation

ROOT = Path(__file__).resolve().parents[3]
ALWAYS = 4 * 120_576 + 4 * 60_288 + 8 * 60_288  # flat fp32 parameters, fp32 master partition, Adam's two states
SIGMA = 4 * 70_400  # the gradient partition
BUCKET = 4 * 4_096
LARGE = 4 * 16_384  # a gradient larger than the bucket, reduced in place
BEFORE = {2: 1_100_000, 4: 2_000_000}  # stated: activations before the first gradient, per micro-batch
AFTER = {2: 700_000, 4: 1_200_000}  # … once gradients exist


@pytest.fixture(scope="module")
def study():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    assert parameter_count(study.model) == 120_576
    entry = TracedActivation(checkpointing="none", precision=Precision.FP32,
                             points=tuple((b, BEFORE[b]) for b in BEFORE),
                             split_points=tuple((b, BEFORE[b], AFTER[b]) for b in BEFORE))
    model = dataclasses.replace(study.model, activations=ActivationSource.TRACE, traced_activations=(entry,))
    return dataclasses.replace(study, model=model)


def _ledger(study, **knobs):
    candidate = with_knobs(baseline_candidate(study.training), knobs)
    return compute_ledger(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)


def _device(ledger, phase):
    return sum(i.bytes for i in ledger.items if i.location is Location.GPU and i.phase in (Phase.ALWAYS, phase))


def test_zero2_with_one_micro_batch_a_step_peaks_before_the_first_gradient(study):
    ledger = _ledger(study, zero_stage=2, micro_batch_size=4)  # 4 × 2 ranks = the global batch of 8
    assert _device(ledger, Phase.FORWARD) == ALWAYS + 2_000_000
    assert _device(ledger, Phase.BACKWARD) == ALWAYS + 1_200_000 + BUCKET + SIGMA + BUCKET + LARGE
    assert ledger.peak_phase is Phase.FORWARD and ledger.training_bytes_at(Location.GPU) == ALWAYS + 2_000_000


def test_zero2_with_accumulation_keeps_the_earlier_micro_batches_partition_beside_the_new_one(study):
    # Each epilogue drops grads_in_partition but all_grad_tensors keeps views of it (stage_1_and_2.py:1038-1045,
    # 2703-2710); the next micro-batch's first reduction allocates a fresh one (:2184-2203): two partitions in
    # its backward. Profiled (benchmarks/peak_attribution.py, grid-llama-cpu z2 fp32 ckpt=full mbs=1): two
    # copy_grads_in_partition buffers live at the measured peak; with one booked, ZeRO-2 with accumulation read
    # 4-11 % under the recorded grids (docs/ledger.md).
    ledger = _ledger(study, zero_stage=2, micro_batch_size=2)  # two micro-batches a step
    assert _device(ledger, Phase.FORWARD) == ALWAYS + 1_100_000 + SIGMA
    assert _device(ledger, Phase.BACKWARD) == ALWAYS + 700_000 + BUCKET + SIGMA + SIGMA + BUCKET + LARGE


def test_the_all_gather_after_the_step_is_counted_on_cpu_ranks_only(study):
    on_cpu = _ledger(study, zero_stage=2, micro_batch_size=4)
    assert _device(on_cpu, Phase.GATHER) == ALWAYS + 4 * 120_576
    gpu = dataclasses.replace(study.hardware, accelerator="cuda", supported_precisions=(Precision.FP32,))
    on_gpu = compute_ledger(candidate=with_knobs(baseline_candidate(study.training), {"zero_stage": 2,
                                                                                     "micro_batch_size": 4}),
                            model=study.model, hardware=gpu, training=study.training)
    assert [i for i in on_gpu.items if i.phase is Phase.GATHER] == []


def test_host_accumulation_is_zero2s_alone(study):
    def host_accumulation(stage):
        ledger = _ledger(study, zero_stage=stage, offload_optimizer="cpu", micro_batch_size=2)
        return [i.bytes for i in ledger.items if i.name.startswith("accumulated gradients on host")]
    assert host_accumulation(2) == [SIGMA] and host_accumulation(1) == []


def test_a_cpu_rank_measurement_leaves_out_the_host_items_at_its_peak(study):
    # ZeRO-2, optimizer on the host: fp32 master 4P, Adam 8P, pinned fp32 gradient partition 4P, the fp32
    # parameter staging partition 4P and temp_grad_buffer_for_cpu_offload 4Lₜ, all pinned and always live
    ledger = _ledger(study, zero_stage=2, offload_optimizer="cpu", micro_batch_size=4)
    assert ledger.training_host_share_bytes == (4 + 8 + 4 + 4) * 60_288 + 4 * 16_384
    on_gpu = dataclasses.replace(ledger, device_is_host=False)
    assert on_gpu.training_host_share_bytes == 0
