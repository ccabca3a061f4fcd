"""The model-state items the whole tables (tests/optimizer/ledger/test_model_state_items.py) do not reach, worked by
hand
(optimizer/ledger/model_states.py): ZeRO-3's gather when the coordinator was replayed over a trace, and the
boundary items of ZeRO-3 with the optimizer offloaded — on a rank count that does not divide the largest tensor,
on CPU ranks, and for tensors past the fp64 norm's 2.5e8-element chunk (stage3.py:1960-1967).

grid-cpu's GPT (Ψ = 120,576; the largest tensor Lₜ = 64·256 = 16,384 elements, the largest module LL = the c_fc
Linear, 16,640 elements; the bucket B = 4,096), bf16 (2 bytes) unless said.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from optimizer.ledger.core import compute_ledger
from optimizer.study.knobs import Precision, with_knobs
from optimizer.study.specs import ActivationSource, baseline_candidate
from optimizer.study.study_file import load_study
from optimizer.study.traced_activation import TracedActivation

ROOT = Path(__file__).resolve().parents[3]
BOUNDARY = "one parameter's gradient partition at the boundary + its fp64 norm"


@pytest.fixture(scope="module")
def study():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    return dataclasses.replace(study, model=dataclasses.replace(study.model, activations=ActivationSource.FORMULA))


def _gpu(study, **hardware):
    return dataclasses.replace(study.hardware, accelerator="cuda", **hardware,
                               supported_precisions=(Precision.FP32, Precision.BF16, Precision.FP16))


def _items(study, knobs, *, hardware, model=None, training=None):
    training = training or study.training
    candidate = with_knobs(baseline_candidate(training), {"zero_stage": 3, "precision": "bf16", "micro_batch_size": 2}
                           | knobs)
    ledger = compute_ledger(candidate=candidate, model=model or study.model, hardware=hardware, training=training)
    return {i.name: (i.bytes, i.formula, i.phase.value, i.location.value, i.category.value) for i in ledger.items}


def _sources(study, model) -> dict[str, str]:
    candidate = with_knobs(baseline_candidate(study.training), {"zero_stage": 3, "precision": "bf16",
                                                                "micro_batch_size": 2})
    ledger = compute_ledger(candidate=candidate, model=model, hardware=_gpu(study), training=study.training)
    return {i.name: i.source for i in ledger.items}


def _traced(study, gathered: int):
    entry = TracedActivation(checkpointing="none", precision=Precision.BF16, points=((2, 500_000),),
                             zero3_gathered=gathered)
    return dataclasses.replace(study.model, activations=ActivationSource.TRACE, traced_activations=(entry,))


def test_a_replayed_gather_replaces_the_module_prefetch_and_reuse_terms(study):
    items = _items(study, {}, hardware=_gpu(study), model=_traced(study, 20_000))
    gathered = "parameters gathered at once (the coordinator replayed over the traced module order)"
    assert items[gathered] == (40_000, "2·G, G = 20,000", "backward", "gpu", "buffers")  # 2 bytes × 20,000 elements
    assert items["full gradient of the module at hand"] == (33_280, "2·LL", "backward", "gpu", "buffers")  # 2 × 16,640
    assert not any(name.startswith(("gathered largest module", "prefetched", "parameters kept")) for name in items)
    assert items["bf16 parameter partition"][:2] == (120_576, "2Q")  # the gather items come beside the rest
    sources = _sources(study, _traced(study, 20_000))
    assert sources[gathered] == "DeepSpeed 0.19.8 partitioned_param_coordinator.py:420-476, 634-665 " \
                                "(optimizer/deepspeed/zero3_gather.py)"
    assert sources["full gradient of the module at hand"] == "DeepSpeed 0.19.8 partition_parameters.py:1329-1346"


def test_a_replayed_gather_is_capped_at_max_live_plus_one_module(study):
    # stage3_max_live_parameters 1e9 (DeepSpeed's default) + LL 16,640: the coordinator's cap
    items = _items(study, {}, hardware=_gpu(study), model=_traced(study, 2_000_000_000))
    gathered = items["parameters gathered at once (the coordinator replayed over the traced module order)"]
    assert gathered == (2_000_033_280, "2·G, G = 1,000,016,640", "backward", "gpu", "buffers")


@pytest.mark.parametrize(("optimizer", "held"), [("cpu", None), ("nvme", 21_848)])
def test_three_ranks_take_the_ceiling_of_the_largest_tensor(study, optimizer, held):
    # x = ⌈16,384 / 3⌉ = 5,462: its bf16 copy 10,924 + max(fp64 norm 43,696, fp32 copy 21,848) = 54,620
    training = dataclasses.replace(study.training, global_batch_size=6)  # 3 ranks × micro-batch 2
    items = _items(study, {"offload_optimizer": optimizer}, training=training,
                   hardware=_gpu(study, gpus_per_node=3, nvme_path="/nvme"))
    assert items[BOUNDARY] == (54_620, "2·⌈Lₜ/N⌉ + 8·⌈Lₜ/N⌉", "backward", "gpu", "buffers")
    copies = items.get("fp32 gradient copies of one reduction, kept for the swap-out")
    # NVMe: ⌈max(B, Lₜ) / 3⌉ = 5,462 fp32 elements = 21,848 bytes
    assert (copies and copies[0]) == held and (held is None or copies[1] == "4·⌈max(B, Lₜ)/N⌉")


def test_on_cpu_ranks_the_device_copy_is_the_host_tensor(study):
    # 2 CPU ranks: x = 8,192, no device copy; max(fp64 norm 65,536, fp32 copy 32,768)
    items = _items(study, {"offload_optimizer": "cpu"}, hardware=study.hardware)
    assert items[BOUNDARY] == (65_536, "8·⌈Lₜ/N⌉", "backward", "gpu", "buffers")


@pytest.mark.parametrize(("vocab", "expected"), [
    # hidden 2,000 on 2 ranks: x = vocab · 2,000 / 2; copy 2x, fp64 norm 8·min(x, 2.5e8), fp32 copy 4x
    (250_000, (2_500_000_000, "2·⌈Lₜ/N⌉ + 8·⌈Lₜ/N⌉")),  # x = 2.5e8: one chunk; 5e8 + 2e9
    (500_000, (3_000_000_000, "2·⌈Lₜ/N⌉ + 8·⌈Lₜ/N⌉ (fp64 in chunks of 2.5e8)")),  # x = 5e8: 1e9 + 2e9 (= 4x)
    (600_000, (3_600_000_000, "2·⌈Lₜ/N⌉ + 4·⌈Lₜ/N⌉ (fp64 in chunks of 2.5e8)")),  # x = 6e8: 1.2e9 + 2.4e9
])
def test_past_one_chunk_the_fp64_norm_stops_growing(study, vocab, expected):
    model = dataclasses.replace(study.model, vocab_size=vocab, hidden_size=2_000)
    items = _items(study, {"offload_optimizer": "cpu"}, hardware=_gpu(study), model=model)
    assert items[BOUNDARY] == (*expected, "backward", "gpu", "buffers")


def test_five_ranks_pad_the_flat_buffer_to_a_multiple_of_2n(study):
    # ZeRO-1/2's flat buffer is padded to a multiple of 2N (stage_1_and_2.py:505-509): ⌈120,576 / 10⌉ · 10 =
    # 120,580 elements, 241,160 bytes in bf16 (the init phase's flat copy, 2Ψ₁₂)
    training = dataclasses.replace(study.training, global_batch_size=10)  # 5 ranks × micro-batch 2
    candidate = with_knobs(baseline_candidate(training), {"zero_stage": 1, "precision": "bf16", "micro_batch_size": 2})
    ledger = compute_ledger(candidate=candidate, model=study.model, training=training,
                            hardware=_gpu(study, gpus_per_node=5))
    flat = [i.bytes for i in ledger.items if i.formula == "2Ψ₁₂"]
    assert flat == [241_160]


def test_one_cpu_rank_all_reduces_too_so_its_flatten_may_be_freed_late(study):
    # DeepSpeed's backward epilogue all-reduces whatever the world size (engine.py:3153-3165, allreduce_bucket
    # flattens, gloo's work holds the flat copy): gpt x1 z0 bf16 of benchmarks/gpu_check.py --dry-run measured
    # 3.941 MB in 4 of 6 runs and 4.269 MB (+2Ψ) in 2 (docs/ledger.md, "ZeRO-0 on gloo")
    one = dataclasses.replace(study.hardware, gpus_per_node=1)
    training = dataclasses.replace(study.training, global_batch_size=2)
    candidate = with_knobs(baseline_candidate(training), {"zero_stage": 0, "precision": "bf16", "micro_batch_size": 2})
    risks = compute_ledger(candidate=candidate, model=study.model, hardware=one, training=training).risks
    assert [i.name for i in risks] == ["allreduce flatten, freed late on gloo's thread"]
    two = with_knobs(baseline_candidate(study.training), {"zero_stage": 0, "precision": "bf16",
                                                          "micro_batch_size": 2})
    assert len(compute_ledger(candidate=two, model=study.model, hardware=study.hardware,
                              training=study.training).risks) == 1  # two ranks: the flatten, freed late on gloo
