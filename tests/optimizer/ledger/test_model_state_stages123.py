"""ZeRO-1/2 and ZeRO-3 model-state items and how transformer_items wires them (optimizer/ledger/model_states.py),
on inputs the whole-ledger tables (tests/optimizer/ledger/test_model_state_items.py) do not reach: two gradient buckets
with
``overlap_comm``, the step's 8Lₜ term winning, a tensor exactly one bucket large, gloo's all-gathered parameters,
the joined gradient lines of a traced joint peak, a tied model's extra head, and the init phase's "room on the
device" test.

The private ``_stage12``/``_stage3`` are called on sizes written by hand (``_Sizes``: every symbol of the module
docstring), so each expected figure is the docstring's formula on small numbers, worked in the comment. The
DeepSpeed 0.19.8 behaviour each one follows is cited (.venv/.../deepspeed/runtime/zero/...). The rest goes
through ``transformer_items`` with grid-cpu's GPT (studies/grid-cpu.yaml), whose figures are counted by hand in
tests/optimizer/ledger/test_model_state_items.py: Ψ = 120,576 on N = 2 (no padding, Ψ₁₂ = Ψ), P = Q = S = 60,288, the
bucket
B = h² = 4,096, the largest module LL = 16,640 elements.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from optimizer.deepspeed.zero_settings import ZeroSettings
from optimizer.ledger.items import Category, Location, Phase
from optimizer.ledger.model_states import _Sizes, _stage3, _stage12, transformer_items
from optimizer.study.inventory import InventoryTensor, ParameterInventory
from optimizer.study.knobs import Candidate, NoCheckpointing, OffloadDevice, Precision, ZeroStage
from optimizer.study.specs import ActivationSource, HardwareSpec
from optimizer.study.study_file import load_study
from optimizer.study.traced_activation import TracedActivation

ROOT = Path(__file__).resolve().parents[3]
STAGE12 = "DeepSpeed 0.19.8 runtime/zero/stage_1_and_2.py"


def _candidate(stage: ZeroStage, precision: Precision = Precision.BF16, *, opt: OffloadDevice = OffloadDevice.NONE,
               mbs: int = 2) -> Candidate:
    return Candidate(zero_stage=stage, offload_optimizer=opt, offload_param=OffloadDevice.NONE, precision=precision,
                     checkpointing=NoCheckpointing(), micro_batch_size=mbs)


def _settings(*, overlap_comm: bool) -> ZeroSettings:
    return ZeroSettings(reduce_bucket_elements=100, allgather_bucket_elements=100, overlap_comm=overlap_comm,
                        contiguous_gradients=True, prefetch_bucket_elements=90, param_persistence_threshold=10,
                        max_reuse_distance=90, max_live_parameters=1_000_000_000, sub_group_size=1_000_000_000)


def _sizes(**changes) -> _Sizes:
    # Ψ = 1,000 on N = 2 (a multiple of 2N: no padding), P = Q = S = 500; g = 2 (bf16); B = 100
    base = dict(psi=1_000, n=2, g=2, padded=1_000, p=500, sigma=600, piece=400, q=500, s=500, k=0,
                largest_tensor=400, largest_module=400, tied=0, bucket=100, gas=1)
    return _Sizes(**(base | changes))


def _one(items, name: str):
    found = [i for i in items if i.name == name]
    assert len(found) == 1, [i.name for i in items]
    return found[0]


# --- _stage12 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("overlap", "name", "expected"), [
    # stage_1_and_2.py:3266-3278: buf_0 of reduce_bucket_size, and with overlap_comm a second one (buf_1)
    (True, "gradient buckets (reduce_bucket_size = 100)", (400, "2·2·B")),  # 2 buffers × 2 bytes × 100
    (False, "gradient bucket (reduce_bucket_size = 100)", (200, "1·2·B")),  # 1 buffer × 2 bytes × 100
])
def test_overlap_comm_doubles_the_zero12_gradient_bucket(overlap, name, expected):
    items = _stage12(_sizes(), _candidate(ZeroStage.GRADIENTS), _settings(overlap_comm=overlap), joined=False,
                     split=False, gloo=False)
    bucket = [i for i in items if i.name.startswith("gradient bucket")]
    assert [(i.name, i.bytes, i.formula, i.category, i.location, i.phase) for i in bucket] == [
        (name, *expected, Category.BUFFERS, Location.GPU, Phase.BACKWARD)]


@pytest.mark.parametrize(("precision", "g", "formula"), [(Precision.BF16, 2, "max(8Lₜ, 6P)"),
                                                         (Precision.FP32, 4, "max(8Lₜ, 4P)")])
def test_the_step_copy_is_8_lt_when_the_largest_tensor_outweighs_the_partition(precision, g, formula):
    # N = 8: Ψ = 1,000 padded to 1,008 (a multiple of 16), P = 126; Lₜ = 400. The step flattens the partition's
    # gradients and casts them to fp32 (:3117-3118): (2 + 4)·126 = 756 bytes in bf16, 4·126 = 504 in fp32, both
    # under the fp64 norm of the largest tensor 8·400 = 3,200 (:3117-3141, as the module's formula says)
    z = _sizes(n=8, g=g, padded=1_008, p=126, largest_tensor=400, bucket=500)
    items = _stage12(z, _candidate(ZeroStage.GRADIENTS, precision), _settings(overlap_comm=False), joined=False,
                     split=False, gloo=False)
    step = _one(items, "flat + fp32 gradient partition in step")
    assert (step.bytes, step.formula, step.phase) == (3_200, formula, Phase.STEP)


@pytest.mark.parametrize(("largest", "in_place"), [(100, None), (101, 202)])
def test_only_a_tensor_larger_than_the_bucket_is_reduced_in_place(largest, in_place):
    # stage_1_and_2.py:1443: `param.numel() > self.reduce_bucket_size` — a tensor of exactly B = 100 elements goes
    # through the bucket; one of 101 is reduced on its own, 2 bytes × 101 = 202 in bf16, in backward
    items = _stage12(_sizes(largest_tensor=largest), _candidate(ZeroStage.GRADIENTS), _settings(overlap_comm=False),
                     joined=False, split=False, gloo=False)
    found = [(i.bytes, i.formula, i.phase) for i in items
             if i.name == "gradient larger than the bucket, reduced in place"]
    assert found == ([] if in_place is None else [(in_place, "2Lₜ", Phase.BACKWARD)])


def test_gloo_allocates_the_all_gathered_flat_parameters_once_more():
    # CPU ranks (gloo): all_gather_dp_groups into the flat group allocates a tensor of the whole padded group,
    # 2 bytes × Ψ₁₂ = 1,000 elements = 2,000 bytes, in the gather after the step (:3155-3158)
    items = _stage12(_sizes(), _candidate(ZeroStage.OPTIMIZER), _settings(overlap_comm=False), joined=False,
                     split=False, gloo=True)
    gathered = _one(items, "bf16 all-gathered parameters (gloo's output tensor)")
    assert (gathered.bytes, gathered.formula, gathered.category, gathered.location, gathered.phase) == (
        2_000, "2Ψ", Category.BUFFERS, Location.GPU, Phase.GATHER)
    assert gathered.source == f"{STAGE12}:3155-3158 (all_gather_dp_groups); gloo"


@pytest.mark.parametrize(("joined", "phases"), [(True, [Phase.REDUCE]), (False, [Phase.BACKWARD, Phase.REDUCE])])
def test_zero1_full_gradients_leave_backward_to_the_joint_line_when_joined(joined, phases):
    # ZeRO-1 keeps the full 16-bit gradients, 2Ψ = 2,000 bytes, until the boundary reduction (:1067); joined, the
    # traced joint line holds them during backward and the item stays for the reduction only
    items = _stage12(_sizes(), _candidate(ZeroStage.OPTIMIZER), _settings(overlap_comm=False), joined=joined,
                     split=False, gloo=False)
    full = [(i.bytes, i.phase) for i in items if i.name == "bf16 gradients (full, until reduced)"]
    assert full == [(2_000, phase) for phase in phases]


# --- _stage3 -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("largest", "ceiling"), [(1_000, 334), (999, 333)])
def test_zero3_step_copy_is_the_fp64_norm_of_the_largest_tensors_partition_when_larger(largest, ceiling):
    # N = 3, a sub-group S = 100 elements: the step's flat + fp32 sub-group (2 + 4)·100 = 600 bytes in bf16
    # (stage3.py:2686-2687); the fp64 norm of one gradient partition, 8·⌈Lₜ/3⌉ (:2456-2457):
    # ⌈1,000/3⌉ = 334 → 2,672 bytes; ⌈999/3⌉ = 333 → 2,664 bytes — both larger than 600
    z = _sizes(n=3, padded=1_002, p=334, q=400, s=100, largest_tensor=largest)
    items = _stage3(z, _candidate(ZeroStage.PARAMETERS), _settings(overlap_comm=True), replayed=0,
                    device_is_host=False)
    step = _one(items, "flat + fp32 gradient sub-group in step")
    assert (step.bytes, step.formula, step.phase) == (8 * ceiling, "max(6S, 8⌈Lₜ/N⌉)", Phase.STEP)
    assert type(step.bytes) is int  # bytes are integers (docs: STYLE.md "Bytes are integers")


# --- transformer_items on grid-cpu's GPT -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def study():
    return load_study(ROOT / "studies" / "grid-cpu.yaml")


def _cuda(study, **changes) -> HardwareSpec:
    return dataclasses.replace(study.hardware, **({"accelerator": "cuda", "device_reserve_bytes": 0,
                                                   "supported_precisions": (Precision.FP32, Precision.BF16,
                                                                            Precision.FP16)} | changes))


def _joint_model(study):
    # a trace at b = 2: high-water mark 1,000 bytes; at the joint peak 700 of activations + 300 of gradients
    entry = TracedActivation(checkpointing="none", precision=Precision.BF16, points=((2, 1_000),),
                             joint_points=((2, 700, 300),))
    return dataclasses.replace(study.model, activations=ActivationSource.TRACE, traced_activations=(entry,))


JOINT_LINES = [("activations where activations + gradients peak (none)", 700, Phase.BACKWARD),
               ("gradients made by that moment of backward", 300, Phase.BACKWARD)]
PEAK_LINE = [("activations, traced high-water mark (none, backward)", 1_000, Phase.BACKWARD)]


@pytest.mark.parametrize(("stage", "grads", "global_batch", "phases", "lines"), [
    # global batch 4 = micro-batch 2 × 2 ranks: one micro-batch a step, so autograd's gradients are in the joint
    # line and counted after backward only: stage 0 in reduce and step (engine.py:3495-3500 frees them after
    # the step), stage 1 in reduce (stage_1_and_2.py:1067); 2Ψ = 241,152 bytes each
    (ZeroStage.DISABLED, "bf16 gradients", 4, [Phase.REDUCE, Phase.STEP], JOINT_LINES),
    (ZeroStage.OPTIMIZER, "bf16 gradients (full, until reduced)", 4, [Phase.REDUCE], JOINT_LINES),
    # global batch 8: two micro-batches a step — the earlier one's gradients are there before backward, not joined
    (ZeroStage.DISABLED, "bf16 gradients", 8, [Phase.ALWAYS], PEAK_LINE),
    (ZeroStage.OPTIMIZER, "bf16 gradients (full, until reduced)", 8, [Phase.BACKWARD, Phase.REDUCE], PEAK_LINE),
])
def test_a_joint_trace_at_one_micro_batch_joins_the_full_gradients(study, stage, grads, global_batch, phases, lines):
    training = dataclasses.replace(study.training, global_batch_size=global_batch)
    items = transformer_items(candidate=_candidate(stage), model=_joint_model(study), hardware=_cuda(study),
                              training=training)
    assert [(i.bytes, i.phase) for i in items if i.name == grads] == [(241_152, phase) for phase in phases]
    traced = [(i.name, i.bytes, i.phase) for i in items if i.source.startswith("trace:")]
    assert traced == lines


def test_a_tied_model_built_on_the_device_holds_its_head_until_tied(study):
    # An inventory of two tensors: the embedding 256 × 64 = 16,384 elements, shared with the head (one tied
    # copy, T = 16,384), and a 64 × 64 Linear, 4,096: Ψ = 20,480. Stage 0 fp32 builds on the device (model_init
    # auto below stage 3): 4Ψ = 81,920 bytes, and the head's own weight until tie_weights, 4T = 65,536.
    tensors = (InventoryTensor(name="embed.weight", module="embed", module_type="Embedding", shape=(256, 64),
                               dtype="float32"),
               InventoryTensor(name="block.weight", module="block", module_type="Linear", shape=(64, 64),
                               dtype="float32"))
    inventory = ParameterInventory(tensors=tensors, tied=(("embed.weight", "head.weight"),))
    model = dataclasses.replace(study.model, inventory=inventory)
    training = dataclasses.replace(study.training, global_batch_size=4)
    items = transformer_items(candidate=_candidate(ZeroStage.DISABLED, Precision.FP32), model=model,
                              hardware=_cuda(study), training=training)
    init = [(i.name, i.bytes, i.formula, i.location) for i in items if i.phase is Phase.INIT]
    assert init == [("whole model built on the device in fp32", 81_920, "4Ψ", Location.GPU),
                    ("tied weight's own copy until it is tied", 65_536, "4·T", Location.GPU)]


@pytest.mark.parametrize(("memory", "reserve", "host"), [
    # room test (stage_1_and_2.py:441-451): capacity − reserve − 2Ψ ≥ 2Ψ₁₂, i.e. capacity − reserve ≥ 482,304.
    # 500,000 − 100,000 = 400,000: no room, both the built parameters and the flat copy on the host, 241,152 each
    (500_000, 100_000, [("bf16 parameters as built, moved to the host", 241_152),
                        ("bf16 flat copy (padded to 2N), made on the host", 241_152)]),
    # 582,304 − 100,000 = 482,304: room, everything on the device — nothing on the host at init
    (582_304, 100_000, []),
])
def test_zero1_flattens_on_the_host_when_the_device_less_its_reserve_has_no_room(study, memory, reserve, host):
    hardware = _cuda(study, gpu_memory_bytes=memory, device_reserve_bytes=reserve)
    items = transformer_items(candidate=_candidate(ZeroStage.OPTIMIZER), model=study.model, hardware=hardware,
                              training=study.training)
    assert [(i.name, i.bytes) for i in items if i.phase is Phase.INIT and i.location is Location.HOST] == host


def test_on_cpu_ranks_init_is_the_one_moment_with_the_largest_total_and_pins_nothing(study):
    # 2 CPU ranks, ZeRO-3 bf16, optimizer on the host (zero.Init: model_init auto at stage 3). Moments, GPU + host:
    # built: partition 2Q 120,576 + largest module gathered 2·2·LL 66,560 = 187,136;
    # defragment: 2Q on the device + 2Q host buffer + master 4Q 241,152 + bucket 2·B 8,192 + 2·2·LL = 557,056;
    # set-up: flat partition 2Q + master 4Q + bucket 8,192 + zero sub-group 4S 241,152 + pinned gradients 4Q
    # 241,152 = 852,224 — the largest, so it alone is init (device and host are one memory). On CPU ranks
    # pin_memory returns the tensor itself (accelerator/cpu_accelerator.py:283-292): no extra 4S copy.
    items = transformer_items(candidate=_candidate(ZeroStage.PARAMETERS, opt=OffloadDevice.CPU), model=study.model,
                              hardware=study.hardware, training=study.training)
    init = [(i.name, i.bytes, i.location) for i in items if i.phase is Phase.INIT]
    assert init == [("bf16 parameter partition (flat)", 120_576, Location.GPU),
                    ("fp32 master partition", 241_152, Location.HOST),
                    ("gradient bucket (reduce_bucket_size = 4,096)", 8_192, Location.GPU),
                    ("zero fp32 gradient sub-group for optimizer set-up", 241_152, Location.HOST),
                    ("fp32 gradient partition (pinned)", 241_152, Location.HOST)]
    assert sum(b for _, b, _ in init) == 852_224
