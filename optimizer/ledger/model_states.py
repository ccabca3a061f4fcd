"""Transformer-mode ledger items: what DeepSpeed 0.19.8 actually allocates, per rank (pure).

Read from DeepSpeed's source (``runtime/engine.py``, ``runtime/zero/stage_1_and_2.py``,
``runtime/zero/stage3.py``, ``runtime/fp16/fused_optimizer.py``, ``runtime/swap_tensor/``) and
checked tensor by tensor on CPU ranks; file:line references are to DeepSpeed 0.19.8. Symbols:

* Ψ parameters, N data-parallel ranks, g bytes per element of the training dtype (fp32 4,
  bf16/fp16 2; DeepSpeed's gradient-accumulation and communication dtypes default to it);
* P = Ψ₁₂/N, the ZeRO-1/2 partition, Ψ₁₂ = Ψ padded to a multiple of 2N (``stage_1_and_2.py:387,441``);
* Σ = the worst rank's P widened to whole tensors at both edges of its range, from the model's parameter order
  (``grads_in_partition``, ``stage_1_and_2.py:2184-2194``; :func:`optimizer.ledger.transformer.zero12_partition`),
  Lₚ the largest part of one tensor inside one rank's range (≤ min(Lₜ, P)), Lₜ the largest parameter tensor;
* Q = Σₚ ⌈nₚ/N⌉, the ZeRO-3 partition (``partition_parameters.py:1690-1696``); S = min(Q, sub_group_size);
* K persistent (never partitioned) elements, LL the largest module, B the reduce bucket, T the tied weights'
  extra copies a model is built with before they are tied (elements).

Model states in mixed precision are the ZeRO paper's 2Ψ + 2Ψ + 12Ψ (16 bytes per parameter) and
DeepSpeed's estimator's 2Ψ + 18Ψ/N at ZeRO-2 (``stage_1_and_2.py:4017-4033``) — with what the estimators
leave out written in: ZeRO-1/2/3 keep a separate FP32 master partition *even in FP32 training*
(``stage_1_and_2.py:560`` clones; ``stage3.py:1162-1172``'s alias is dead code), the buckets, the step's
transient FP32 gradient copy, and ZeRO-3's persistent small parameters and gathered modules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from optimizer.deepspeed.versions import LEDGER_DEEPSPEED_VERSION
from optimizer.deepspeed.zero_settings import (
    DEEPSPEED_OPTIMIZER_SWAP_BUFFERS,
    DEEPSPEED_PARAM_MAX_IN_CPU,
    DEEPSPEED_PARAM_SWAP_BUFFER_ELEMENTS,
    DEEPSPEED_PARAM_SWAP_BUFFERS,
    ZeroSettings,
    zero_settings,
)
from optimizer.ledger.activations import activation_items, joint_trace, usable_trace
from optimizer.ledger.init_phase import construction_moments, init_items, init_moments, moment_bytes, parameter_location
from optimizer.ledger.items import Category, LedgerItem, Location, Phase
from optimizer.ledger.transformer import (
    largest_layer_parameters,
    largest_tensor_parameters,
    parameter_count,
    persistent_parameters,
    tied_copy_elements,
    zero3_partition_elements,
    zero12_partition,
)
from optimizer.study.constraints import gradient_accumulation_steps
from optimizer.study.knobs import Candidate, OffloadDevice, Precision, ZeroStage
from optimizer.study.specs import Accelerator, HardwareSpec, TrainingSpec, TransformerModel

DS = f"DeepSpeed {LEDGER_DEEPSPEED_VERSION}"
"""The release the items' file:line sources refer to (:mod:`optimizer.deepspeed.versions`)."""
STAGE12 = f"{DS} runtime/zero/stage_1_and_2.py"
STAGE3 = f"{DS} runtime/zero/stage3.py"
FP32 = 4
ADAM_STATE_BYTES = 8
"""exp_avg + exp_avg_sq, FP32 (the dtype of the master weights)."""
STAGE0_ALLREDUCE_ELEMENTS = 500_000_000
"""``MEMORY_OPT_ALLREDUCE_SIZE`` (``engine.py:151``): stage 0 flattens gradients in chunks this large."""
OFFLOAD_NORM_CHUNK = 250_000_000
"""ZeRO-3's ``_constant_buffered_norm2`` converts at most this many elements to fp64 at once
(``stage3.py:1960-1967``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Sizes:
    """The element counts every formula below uses."""

    psi: int
    n: int
    g: int
    padded: int
    p: int
    sigma: int
    piece: int
    q: int
    s: int
    k: int
    largest_tensor: int
    largest_module: int
    tied: int
    bucket: int
    gas: int


def _sizes(*, model: TransformerModel, candidate: Candidate, hardware: HardwareSpec, training: TrainingSpec,
           settings: ZeroSettings) -> _Sizes:
    psi = parameter_count(model)
    n = hardware.world_size
    padded = -(-psi // (2 * n)) * (2 * n)
    p = padded // n
    largest_tensor = largest_tensor_parameters(model)
    flat = zero12_partition(model, ranks=n)
    q = zero3_partition_elements(model, ranks=n)
    return _Sizes(
        psi=psi, n=n, g=candidate.precision.bytes_per_element, padded=padded, p=p,
        sigma=flat.held, piece=flat.largest_piece, q=q, s=min(q, settings.sub_group_size),
        k=persistent_parameters(model, threshold=settings.param_persistence_threshold),
        largest_tensor=largest_tensor, largest_module=largest_layer_parameters(model),
        tied=tied_copy_elements(model), bucket=settings.reduce_bucket_elements,
        gas=gradient_accumulation_steps(candidate=candidate, hardware=hardware, training=training),
    )


def _place(device: OffloadDevice) -> Location:
    return {OffloadDevice.NONE: Location.GPU, OffloadDevice.CPU: Location.HOST, OffloadDevice.NVME: Location.NVME}[
        device
    ]


def _item(name: str, category: Category, location: Location, num_bytes: int, formula: str, source: str,
          phase: Phase = Phase.ALWAYS) -> LedgerItem:
    return LedgerItem(name=name, category=category, location=location, bytes=num_bytes, formula=formula,
                      source=source, phase=phase)


def _stage0(z: _Sizes, precision: Precision, *, joined: bool, gloo: bool) -> list[LedgerItem]:
    """Stage 0: FusedAdam directly (fp32), or ``FP16_Optimizer`` with a flat FP32 master (bf16/fp16). With
    ``joined`` the gradients autograd makes during backward are in the traced joint line, so the full ones are
    counted after backward only (``engine.py:3495-3500`` sets every ``.grad`` to None after the step)."""
    g, psi = z.g, z.psi
    flatten = g * min(psi, STAGE0_ALLREDUCE_ELEMENTS + z.largest_tensor)
    grads = [_item(f"{precision} gradients", Category.GRADS, Location.GPU, g * psi, f"{g}Ψ",
                   f"{DS} engine.py (autograd)", phase) for phase in (Phase.REDUCE, Phase.STEP)] if joined else \
        [_item(f"{precision} gradients", Category.GRADS, Location.GPU, g * psi, f"{g}Ψ", f"{DS} engine.py (autograd)")]
    items = [
        _item(f"{precision} parameters", Category.PARAMS, Location.GPU, g * psi, f"{g}Ψ", f"{DS} engine.py"),
        *grads,
        _item("Adam exp_avg + exp_avg_sq (fp32)", Category.OPTIMIZER, Location.GPU, ADAM_STATE_BYTES * psi, "8Ψ",
              "ZeRO paper §3; fused_adam.py:153-157"),
        _item("allreduce flatten (≤ 5e8 + Lₜ elements)", Category.BUFFERS, Location.GPU, flatten,
              f"{g}·min(Ψ, 5e8 + Lₜ)", f"{DS} engine.py:3073-3095 (MEMORY_OPT_ALLREDUCE_SIZE)", Phase.REDUCE),
    ]
    if gloo:  # gloo's work object holds the flattened tensor and may drop it on its own thread after the step
        # began: the same 2-rank candidate measured 3.94 and 4.27 MB in two runs, 2Ψ apart (docs/ledger.md) — risk.
        items.append(replace(_item("allreduce flatten, freed late on gloo's thread", Category.BUFFERS, Location.GPU,
                                   flatten, f"{g}·min(Ψ, 5e8 + Lₜ)", f"{DS} engine.py:3073-3095; gloo", Phase.STEP),
                             sometimes=True))
    if precision is not Precision.FP32:
        items += [
            _item("fp32 master weights (flat)", Category.MASTER_WEIGHTS, Location.GPU, FP32 * psi, "4Ψ",
                  f"{DS} runtime/fp16/fused_optimizer.py:100"),
            _item("fp32 gradient list + flat copy in step", Category.GRADS, Location.GPU, 2 * FP32 * psi, "8Ψ",
                  f"{DS} runtime/fp16/fused_optimizer.py:285-288", Phase.STEP),
        ]
    return items


def _stage12(z: _Sizes, candidate: Candidate, settings: ZeroSettings, *, joined: bool,
             split: bool, gloo: bool) -> list[LedgerItem]:
    """ZeRO-1/2 (``DeepSpeedZeroOptimizer``), optionally with the optimizer on the CPU. With ``joined`` (stage 1)
    the full gradients of backward are in the traced joint line; with ``split`` (stage 2) the activations are
    two lines, before the first gradient (phase ``forward``: no bucket or partition yet) and after. With
    ``gloo`` (CPU ranks) the all-gather after the step allocates the gathered parameters once more."""
    g, p, sigma = z.g, z.p, z.sigma
    stage1 = candidate.zero_stage is ZeroStage.OPTIMIZER
    offload = candidate.offload_optimizer is OffloadDevice.CPU
    buckets = 2 if settings.overlap_comm else 1
    prec = candidate.precision
    items = [
        _item(f"{prec} parameters (flat, full)", Category.PARAMS, Location.GPU, g * z.padded, f"{g}Ψ",
              f"{STAGE12}:505-509"),
        _item(f"gradient bucket{'s' if buckets > 1 else ''} (reduce_bucket_size = {z.bucket:,})", Category.BUFFERS,
              Location.GPU, buckets * g * z.bucket, f"{buckets}·{g}·B", f"{STAGE12}:3266-3278",
              Phase.ALWAYS if stage1 else Phase.BACKWARD),
    ]
    if gloo:
        # all_gather_dp_groups (runtime/utils.py) into the flat parameters: over gloo the profiled ranks allocated
        # a tensor of the whole flat group under c10d::_allgather_base_ (benchmarks/peak_attribution.py).
        items.append(_item(f"{prec} all-gathered parameters (gloo's output tensor)", Category.BUFFERS, Location.GPU,
                           g * z.padded, f"{g}Ψ", f"{STAGE12}:3155-3158 (all_gather_dp_groups); gloo", Phase.GATHER))
    if stage1:
        # Full low-precision gradients until the boundary reduction clears them (:1067).
        for phase in (Phase.REDUCE,) if joined else (Phase.BACKWARD, Phase.REDUCE):
            items.append(_item(f"{prec} gradients (full, until reduced)", Category.GRADS, Location.GPU,
                               g * z.psi, f"{g}Ψ", f"{STAGE12}:1067", phase))
    state_place = Location.HOST if offload else Location.GPU
    reduce_phase = Phase.BACKWARD if not stage1 else Phase.REDUCE
    items += [
        _item("fp32 master partition", Category.MASTER_WEIGHTS, state_place, FP32 * p, "4P",
              f"{STAGE12}:560 (.clone(), also in fp32 training)"),
        _item("Adam exp_avg + exp_avg_sq (fp32)", Category.OPTIMIZER, state_place, ADAM_STATE_BYTES * p, "8P",
              "ZeRO paper §3 (partitioned over N)"),
    ]
    if offload:
        items += [
            _item("fp32 gradient partition (pinned)", Category.GRADS, Location.HOST, FP32 * p, "4P",
                  f"{STAGE12}:936-940"),
            _item(f"{prec} parameter staging partition (pinned)", Category.BUFFERS, Location.HOST, g * p, f"{g}P",
                  f"{STAGE12}:566-575"),
            _item("temp_grad_buffer_for_cpu_offload (pinned)", Category.BUFFERS, Location.HOST,
                  g * z.largest_tensor, f"{g}Lₜ", f"{STAGE12}:653-658"),
            _item("temp_grad_buffer_for_gpu_offload", Category.BUFFERS, Location.GPU, g * z.largest_tensor,
                  f"{g}Lₜ", f"{STAGE12}:659-661"),
            # The norm is taken on the device per parameter as its gradient leaves for the host at the boundary
            # (copy_grads_in_partition, :2161-2176): its piece in range in fp64 (:1886), then, that freed, the
            # piece's fp32 copy (:1900; 4Lₚ, none in fp32 training). The step sums the stored norms (:1914-1954)
            # and updates on the host (:3078-3099): nothing of the parameters' size on the device.
            _item("fp64 norm of one parameter's piece of the partition (at the boundary)", Category.BUFFERS,
                  Location.GPU, 8 * z.piece, "8Lₚ", f"{STAGE12}:1873-1886, 1900, 2161-2176", reduce_phase),
        ]
        if z.gas > 1 and not stage1:
            # Kept per parameter in a dict that is never cleared (:1852-1853). Stage 1 reduces at the boundary
            # only (:2293-2295), after the last micro-batch's backward, so nothing accumulates on the host (a
            # profiled 2-rank stage-1 run with GAS = 4 made no allocation there).
            items.append(_item("accumulated gradients on host (GAS > 1, pinned)", Category.GRADS, Location.HOST,
                               g * sigma, f"{g}Σ", f"{STAGE12}:1820-1826, 1853 (every tensor the rank owns, in full)"))
        return items
    if not stage1 and z.gas > 1:
        # The partition the earlier micro-batches filled stays live through the next one's backward: each epilogue
        # drops grads_in_partition (:924-930, 1061) but keeps its views in all_grad_tensors (:1038-1045, 2703-2710),
        # and the next reduction allocates a fresh one (:2184-2203) — two live at ZeRO-2's backward peak
        # (benchmarks/peak_attribution.py, grid-llama-cpu z2 fp32 ckpt=full mbs=1: 2× copy_grads_in_partition).
        for phase in (Phase.FORWARD, Phase.BACKWARD) if split else (Phase.BACKWARD,):
            items.append(_item(f"{prec} gradient partition of the earlier micro-batches (GAS > 1)", Category.GRADS,
                               Location.GPU, g * sigma, f"{g}Σ", f"{STAGE12}:1038-1045, 2184-2203", phase))
    items += [
        _item(f"{prec} gradient partition (grads_in_partition, allocated at the first reduction)",
              Category.GRADS, Location.GPU, g * sigma, f"{g}Σ", f"{STAGE12}:2184-2203", reduce_phase),
        _item("reduction flatten (≤ one bucket)", Category.BUFFERS, Location.GPU, g * z.bucket, f"{g}·B",
              f"{STAGE12}:2367-2376", reduce_phase),
        _item(f"{prec} gradient partition (until step)", Category.GRADS, Location.GPU, g * sigma, f"{g}Σ",
              f"{STAGE12}:3128-3131", Phase.STEP),
        # .to(fp32) of an fp32 partition is the same tensor (:3118): one copy in fp32 training, two in 16-bit
        _item("flat + fp32 gradient partition in step", Category.GRADS, Location.GPU,
              max(8 * z.largest_tensor, (g + (FP32 if g != FP32 else 0)) * p),
              f"max(8Lₜ, {g + (FP32 if g != FP32 else 0)}P)", f"{STAGE12}:3117-3141", Phase.STEP),
    ]
    if not stage1 and z.largest_tensor > z.bucket:
        items.append(_item("gradient larger than the bucket, reduced in place", Category.GRADS, Location.GPU,
                           g * z.largest_tensor, f"{g}Lₜ", f"{STAGE12}:1443-1449", Phase.BACKWARD))
    return items


def _stage3(z: _Sizes, candidate: Candidate, settings: ZeroSettings, *, replayed: int,
            device_is_host: bool) -> list[LedgerItem]:
    """ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``) with optimizer and/or parameter offload. ``replayed``: the
    parameter elements the traced replay of DeepSpeed's coordinator keeps gathered at once (0: not traced,
    the largest module twice + one prefetch bucket + the reuse window instead). ``device_is_host`` (CPU ranks):
    moving a host gradient partition "to the device" makes no copy."""
    g, q = z.g, z.q
    prec = candidate.precision
    opt = candidate.offload_optimizer
    param = candidate.offload_param
    # Parameters: the partition, the persistent small tensors, and what is gathered for compute.
    if param is OffloadDevice.NVME:
        in_cpu = min(q, DEEPSPEED_PARAM_MAX_IN_CPU)
        items: list[LedgerItem] = [
            _item(f"{prec} parameter partition held in pinned RAM (max_in_cpu)", Category.PARAMS, Location.HOST,
                  g * in_cpu, f"{g}·min(Q, max_in_cpu)", f"{STAGE3}:888-911"),
            _item(f"{prec} parameter partition files", Category.PARAMS, Location.NVME, g * q, f"{g}Q",
                  f"{DS} partition_parameters.py:1816-1824"),
            _item("parameter swap buffers (buffer_count × buffer_size)", Category.BUFFERS, Location.HOST,
                  DEEPSPEED_PARAM_SWAP_BUFFERS * DEEPSPEED_PARAM_SWAP_BUFFER_ELEMENTS * g, f"5·1e8·{g}",
                  f"{DS} swap_tensor/partitioned_param_swapper.py:104-127"),
        ]
    else:
        items = [_item(f"{prec} parameter partition{' (pinned)' if param is OffloadDevice.CPU else ''}",
                       Category.PARAMS, _place(param), g * q, f"{g}Q", f"{STAGE3}:906-907, 970-973")]
    items.append(_item(f"persistent parameters (≤ {settings.param_persistence_threshold:,} elements each)",
                       Category.PARAMS, Location.GPU, g * z.k, f"{g}K", f"{DS} parameter_offload.py:317-330"))
    if z.n == 1 and param is OffloadDevice.NONE:
        # One rank: "gathering" points each parameter at its device partition, a view (NoGatherHandle,
        # partition_parameters.py:61-75, taken at :1559-1560 when every partition's world size is 1).
        items += [
            _item("parameters gathered (one rank: views of the partition, no copy)", Category.BUFFERS, Location.GPU,
                  0, "0", f"{DS} partition_parameters.py:61-75, 1559-1560", Phase.BACKWARD),
            _item("full gradient of the module at hand", Category.BUFFERS, Location.GPU, g * z.largest_module,
                  f"{g}·LL", f"{DS} partition_parameters.py:1329-1346", Phase.BACKWARD)]
    elif replayed:
        # DeepSpeed's coordinator replayed over the traced module order: its prefetch marks keep parameters
        # gathered from their forward use to their backward one; at most max_live + one module past it.
        gathered = min(replayed, settings.max_live_parameters + z.largest_module)
        items += [
            _item("parameters gathered at once (the coordinator replayed over the traced module order)",
                  Category.BUFFERS, Location.GPU, g * gathered, f"{g}·G, G = {gathered:,}",
                  f"{DS} partitioned_param_coordinator.py:420-476, 634-665 (optimizer/deepspeed/zero3_gather.py)",
                  Phase.BACKWARD),
            _item("full gradient of the module at hand", Category.BUFFERS, Location.GPU, g * z.largest_module,
                  f"{g}·LL", f"{DS} partition_parameters.py:1329-1346", Phase.BACKWARD)]
    else:
        items += [
            _item("gathered largest module + its full gradient", Category.BUFFERS, Location.GPU,
                  2 * g * z.largest_module, f"2·{g}·LL", f"{DS} partition_parameters.py:1329-1346", Phase.BACKWARD),
            _item(f"prefetched parameters (stage3_prefetch_bucket_size = {settings.prefetch_bucket_elements:,})",
                  Category.BUFFERS, Location.GPU, g * min(settings.prefetch_bucket_elements, z.psi),
                  f"{g}·prefetch", f"{DS} partitioned_param_coordinator.py:452-454", Phase.BACKWARD),
            _item(f"parameters kept for reuse (stage3_max_reuse_distance = {settings.max_reuse_distance:,})",
                  Category.BUFFERS, Location.GPU, g * min(settings.max_reuse_distance, z.psi), f"{g}·reuse",
                  f"{DS} partitioned_param_coordinator.py:634-664", Phase.BACKWARD)]
    items += [
        _item(f"gradient bucket (reduce_bucket_size = {z.bucket:,})", Category.BUFFERS, Location.GPU,
              g * z.bucket, f"{g}·B", f"{STAGE3}:779-784 (persistent)"),
        _item("reduce-scatter concat (≤ one bucket)", Category.BUFFERS, Location.GPU, g * z.bucket, f"{g}·B",
              f"{DS} runtime/comm/coalesced_collectives.py:109-122", Phase.BACKWARD),
    ]
    # Gradients and optimizer states.
    grad_place = Location.GPU if opt is OffloadDevice.NONE else Location.HOST
    items.append(_item(f"{prec} gradient partition{' (pinned)' if grad_place is Location.HOST else ''}",
                       Category.GRADS, grad_place, g * q, f"{g}Q", f"{STAGE3}:791-796"))
    if opt is OffloadDevice.NONE:
        items += [
            _item("fp32 master partition", Category.MASTER_WEIGHTS, Location.GPU, FP32 * q, "4Q",
                  f"{STAGE3}:1169-1172 (a copy, also in fp32 training)"),
            _item("Adam exp_avg + exp_avg_sq (fp32)", Category.OPTIMIZER, Location.GPU, ADAM_STATE_BYTES * q, "8Q",
                  "ZeRO paper §3 (partitioned over N)"),
            _item("flat + fp32 gradient sub-group in step", Category.GRADS, Location.GPU,
                  max((g + FP32) * z.s, 8 * -(-z.largest_tensor // z.n)), f"max({g + FP32}S, 8⌈Lₜ/N⌉)",
                  f"{STAGE3}:2686-2687, 2456-2457", Phase.STEP),
        ]
        return items
    items += _offload_boundary_items(z, opt, device_is_host=device_is_host)
    if opt is OffloadDevice.CPU:
        items += [
            _item("fp32 master partition", Category.MASTER_WEIGHTS, Location.HOST, FP32 * q, "4Q",
                  f"{STAGE3}:1157-1160"),
            _item("fp32 gradient partition (pinned)", Category.GRADS, Location.HOST, FP32 * q, "4Q",
                  f"{STAGE3}:1337-1342"),
            _item("Adam exp_avg + exp_avg_sq (fp32)", Category.OPTIMIZER, Location.HOST, ADAM_STATE_BYTES * q, "8Q",
                  "ZeRO-Offload (Ren et al. 2021)"),
        ]
        return items
    items += [
        _item("fp32 master partition (swapped)", Category.MASTER_WEIGHTS, Location.NVME, FP32 * q, "4Q",
              f"{DS} swap_tensor/optimizer_utils.py:102-109"),
        _item("Adam exp_avg + exp_avg_sq (swapped)", Category.OPTIMIZER, Location.NVME, ADAM_STATE_BYTES * q, "8Q",
              f"{DS} swap_tensor/optimizer_utils.py:256-283"),
        _item("fp32 gradient files", Category.GRADS, Location.NVME, FP32 * q, "4Q",
              f"{DS} swap_tensor/optimizer_utils.py:256-283"),
        _item("optimizer swap buffers (buffer_count × S, fp32, page-locked)", Category.BUFFERS, Location.HOST,
              DEEPSPEED_OPTIMIZER_SWAP_BUFFERS * FP32 * z.s, "4·4S", f"{DS} swap_tensor/optimizer_utils.py:184-192"),
    ]
    return items


def _offload_boundary_items(z: _Sizes, opt: OffloadDevice, *, device_is_host: bool) -> list[LedgerItem]:
    """ZeRO-3 with the optimizer offloaded: at the accumulation boundary (in the last micro-batch's backward),
    ``partition_grads`` takes each parameter's reduced partition, x = ⌈nₚ/N⌉ elements, in turn
    (``stage3.py:2006-2053``): a device copy of it (``:2022-2028, 2034``, ``.to`` the device: none on CPU ranks), its
    fp64 norm (``_offload_grad_partition_at_boundary``, ``:1446``, in chunks of ≤ 2.5e8 elements, ``:1960-1967``),
    then, that freed, its fp32 copy for the host (``:1457``; none in fp32 training). The next parameter's copy
    replaces it; a parameter larger than the bucket is reduced alone (``:1583, 1626``), so x ≤ ⌈Lₜ/N⌉. The step
    only sums the stored norms (``:1975-2004``). With NVMe the fp32 copies of one reduction are kept in a list
    until they are swapped out together (``:1449-1453, 2053``): at most ⌈max(B, Lₜ)/N⌉ elements, read from the
    source, not measured (in fp32 training it holds the device copies themselves: the current one is counted
    twice here)."""
    g = z.g
    x = -(-z.largest_tensor // z.n)
    copy = 0 if device_is_host else g * x
    cast = FP32 * x if g != FP32 else 0
    norm = 8 * min(x, OFFLOAD_NORM_CHUNK)
    chunked = "" if x <= OFFLOAD_NORM_CHUNK else " (fp64 in chunks of 2.5e8)"
    formula = ("" if device_is_host else f"{g}·⌈Lₜ/N⌉ + ") + ("8·⌈Lₜ/N⌉" if norm >= cast else "4·⌈Lₜ/N⌉") + chunked
    items = [_item("one parameter's gradient partition at the boundary + its fp64 norm", Category.BUFFERS,
                   Location.GPU, copy + max(norm, cast), formula, f"{STAGE3}:1443-1457, 1960-1967, 2022-2044",
                   Phase.BACKWARD)]
    if opt is OffloadDevice.NVME:
        held = -(-max(z.bucket, z.largest_tensor) // z.n)
        items.append(_item("fp32 gradient copies of one reduction, kept for the swap-out", Category.BUFFERS,
                           Location.GPU, FP32 * held, "4·⌈max(B, Lₜ)/N⌉", f"{STAGE3}:1449-1453, 2053",
                           Phase.BACKWARD))
    return items


def construction_bytes(*, candidate: Candidate, model: TransformerModel, hardware: HardwareSpec,
                       training: TrainingSpec) -> int:
    """Per-rank device bytes (CPU ranks: device + host) at the peak of building the model alone, before
    ``deepspeed.initialize`` (:func:`optimizer.ledger.init_phase.construction_moments`)."""
    settings = zero_settings(model=model, stage=candidate.zero_stage)
    z = _sizes(model=model, candidate=candidate, hardware=hardware, training=training, settings=settings)
    moments = construction_moments(
        construction=training.construction(candidate.zero_stage), precision=candidate.precision, g=z.g, psi=z.psi,
        q=z.q, largest_module=z.largest_module, tied=z.tied,
        param_place=parameter_location(candidate.offload_param))
    device_is_host = hardware.accelerator is Accelerator.CPU
    return max(moment_bytes(m, device_is_host=device_is_host) for m in moments)


def transformer_items(
    *, candidate: Candidate, model: TransformerModel, hardware: HardwareSpec, training: TrainingSpec
) -> list[LedgerItem]:
    """Every per-rank item for ``candidate`` (valid, as checked by the caller)."""
    settings = zero_settings(model=model, stage=candidate.zero_stage)
    z = _sizes(model=model, candidate=candidate, hardware=hardware, training=training, settings=settings)
    stage = candidate.zero_stage
    # Autograd's own .grad tensors grow during backward at stages 0 and 1 (one micro-batch per step: with
    # more, the earlier micro-batches' gradients are all there when the next backward starts); with the
    # optimizer offloaded too, since stage 1 reduces after backward (stage_1_and_2.py:2293-2295, overlap_comm
    # off). ZeRO-2's bucket and partition appear at the first gradient's hook: its activations are split there.
    joined = stage in (ZeroStage.DISABLED, ZeroStage.OPTIMIZER) and z.gas == 1 \
        and joint_trace(model, candidate) is not None
    traced = usable_trace(model, candidate)
    split = stage is ZeroStage.GRADIENTS and traced is not None and bool(traced.split_points)
    if stage is ZeroStage.DISABLED:
        items = _stage0(z, candidate.precision, joined=joined,
                        gloo=hardware.accelerator is Accelerator.CPU and z.n > 1)
    elif stage is ZeroStage.PARAMETERS:
        items = _stage3(z, candidate, settings, replayed=traced.zero3_gathered if traced is not None else 0,
                        device_is_host=hardware.accelerator is Accelerator.CPU)
    else:
        items = _stage12(z, candidate, settings, joined=joined, split=split,
                         gloo=hardware.accelerator is Accelerator.CPU)

    items += activation_items(model=model, candidate=candidate, sequence_length=training.sequence_length,
                              element_bytes=z.g, joined=joined, split=split)
    moments = init_moments(candidate=candidate, construction=training.construction(stage), psi=z.psi,
                           padded=z.padded, p=z.p, q=z.q, s=z.s, largest_tensor=z.largest_tensor,
                           largest_module=z.largest_module, tied=z.tied, bucket=z.bucket,
                           device_bytes=None if hardware.accelerator is Accelerator.CPU
                           else hardware.gpu_memory_bytes - hardware.device_reserve_bytes)
    items += init_items(moments, device_is_host=hardware.accelerator is Accelerator.CPU)
    return items
