"""ZeRO-3's model-state items (``DeepSpeedZeroOptimizer_Stage3``, DeepSpeed 0.19.8): the parameter partition, what is
gathered, the gradient partition, master weights and Adam states on the device, the host or NVMe (pure; symbols
as in :mod:`optimizer.ledger.model_states`)."""

from __future__ import annotations

from optimizer.deepspeed.zero_settings import (
    DEEPSPEED_OPTIMIZER_SWAP_BUFFERS,
    DEEPSPEED_PARAM_MAX_IN_CPU,
    DEEPSPEED_PARAM_SWAP_BUFFER_ELEMENTS,
    DEEPSPEED_PARAM_SWAP_BUFFERS,
    ZeroSettings,
)
from optimizer.ledger.items import Category, LedgerItem, Location, Phase
from optimizer.ledger.state_sizes import (
    ADAM_STATE_BYTES,
    DS,
    FP32,
    OFFLOAD_NORM_CHUNK,
    STAGE3,
    _item,
    _place,
    _Sizes,
)
from optimizer.study.knobs import Candidate, OffloadDevice


def gathers(z: _Sizes, candidate: Candidate) -> bool:
    """Whether ZeRO-3 gathers parameters into new device memory: not on one rank with the partition on the device,
    where a gathered parameter is a view of its partition (``partition_parameters.py:61-75, 1559-1560``)."""
    return z.n > 1 or candidate.offload_param is not OffloadDevice.NONE


def _stage3(z: _Sizes, candidate: Candidate, settings: ZeroSettings, *, replayed: int,
            device_is_host: bool, joint_bytes: int | None = None, autograd_bytes: int = 0,
            autograd_held: int = 0) -> list[LedgerItem]:
    """ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``) with optimizer and/or parameter offload. ``replayed``: the
    parameter elements the traced replay of DeepSpeed's coordinator keeps gathered at once (0: not traced,
    the largest module twice + one prefetch bucket + the reuse window instead). ``joint_bytes``: what the replay
    holds gathered, in bytes, at the traced moment the activations and the gathered parameters together peak
    (:meth:`optimizer.study.traced_activation.TracedActivation.zero3_joint_at`; the activation lines then are that
    moment's too). ``autograd_bytes``: at that moment, the released parameters' copies autograd still holds —
    4-bit weights bitsandbytes' matmul kept for backward, this micro-step's and the previous one's
    (:func:`optimizer.deepspeed.zero3_gather.autograd_copies`): not the coordinator's, so not under its
    ``max_live``; ``autograd_held`` the bytes of all those weights: what the coordinator's ``max_live`` releases of
    them stays too (the traced depths hold everything gathered, a deep model is over ``max_live``). ``device_is_host``
    (CPU ranks): moving a host gradient partition "to the device" makes no
    copy."""
    g, q, qt, qsym = z.g, z.q, z.q_trainable, z.q_tr
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
        # PEFT's adapters kept fp32 (constraints.adapters_kept_fp32): 4 bytes each, in partition and when persistent
        up = FP32 - g
        items = [_item(f"{prec} parameter partition{' (pinned)' if param is OffloadDevice.CPU else ''}"
                       + (" (the adapters' in fp32)" if z.q_adapter else ""), Category.PARAMS, _place(param),
                       g * q + up * z.q_adapter, f"{g}Q" + (f" + {up}Qₐ" if z.q_adapter else ""),
                       f"{STAGE3}:906-907, 970-973" + (f"; {DS} runtime/zero/utils.py:215-243" if z.q_adapter else ""))]
    items.append(_item(f"persistent parameters (≤ {settings.param_persistence_threshold:,} elements each)"
                       + (" (the adapters' in fp32)" if z.k_adapter else ""), Category.PARAMS, Location.GPU,
                       g * z.k + (FP32 - g) * z.k_adapter, f"{g}K" + (f" + {FP32 - g}Kₐ" if z.k_adapter else ""),
                       f"{DS} parameter_offload.py:317-330"))
    if not gathers(z, candidate):
        # One rank: "gathering" points each parameter at its device partition, a view (NoGatherHandle,
        # partition_parameters.py:61-75, taken at :1559-1560 when every partition's world size is 1).
        items += [
            _item("parameters gathered (one rank: views of the partition, no copy)", Category.BUFFERS, Location.GPU,
                  0, "0", f"{DS} partition_parameters.py:61-75, 1559-1560", Phase.BACKWARD),
            _grad_of_module(z)]
    elif joint_bytes is not None:
        # The replay's gathered parameters at the moment they and the activations together peak: with full
        # checkpointing the gathers peak at the turn to backward, the activations while a block is recomputed.
        cap = g * (settings.max_live_parameters + z.largest_module)
        items += [
            _item("parameters gathered where they and the activations together peak (the coordinator replayed "
                  "over the traced step)", Category.BUFFERS, Location.GPU, min(joint_bytes, cap),
                  "traced: each tensor in its own dtype",
                  f"{DS} partitioned_param_coordinator.py:420-476, 634-665 (optimizer/deepspeed/zero3_gather.py)",
                  Phase.BACKWARD),
            _grad_of_module(z)]
        released = min(max(0, joint_bytes - cap), autograd_held)  # over max_live, released: autograd keeps them
        if autograd_bytes + released:
            items.append(_item("released 4-bit weights bitsandbytes' matmul still holds (this micro-step's and, while "
                               "the loop keeps its last loss, the previous one's)", Category.BUFFERS, Location.GPU,
                               autograd_bytes + released, "traced: packed bytes" + (
                                   f" + {released / 1e9:,.1f} GB released over max_live" if released else ""),
                               f"bitsandbytes 0.50.2 autograd/_functions.py:357-358 (ctx.tensors); "
                               f"{DS} partition_parameters.py:329 (optimizer/deepspeed/zero3_gather.py)",
                               Phase.BACKWARD))
    elif replayed:
        # DeepSpeed's coordinator replayed over the traced module order: its prefetch marks keep parameters
        # gathered from their forward use to their backward one; at most max_live + one module past it.
        gathered = min(replayed, settings.max_live_parameters + z.largest_module)
        items += [
            _item("parameters gathered at once (the coordinator replayed over the traced module order)",
                  Category.BUFFERS, Location.GPU, g * gathered, f"{g}·G, G = {gathered:,}",
                  f"{DS} partitioned_param_coordinator.py:420-476, 634-665 (optimizer/deepspeed/zero3_gather.py)",
                  Phase.BACKWARD),
            _grad_of_module(z)]
    elif z.full:
        items += [
            _item("gathered largest module + its full gradient", Category.BUFFERS, Location.GPU,
                  2 * g * z.largest_module, f"2·{g}·LL", f"{DS} partition_parameters.py:1329-1346", Phase.BACKWARD),
            *_prefetch_and_reuse(z, settings)]
    else:  # the gathered module holds frozen weights too; its full gradient only the trainable ones
        items += [
            _item("gathered largest module", Category.BUFFERS, Location.GPU, g * z.largest_module, f"{g}·LL",
                  f"{DS} partition_parameters.py:1329-1346", Phase.BACKWARD),
            _grad_of_module(z), *_prefetch_and_reuse(z, settings)]
    items += [
        _item(f"gradient bucket (reduce_bucket_size = {z.bucket:,})", Category.BUFFERS, Location.GPU,
              g * z.bucket, f"{g}·B", f"{STAGE3}:779-784 (persistent)"),
        _item("reduce-scatter concat (≤ one bucket)", Category.BUFFERS, Location.GPU, g * z.bucket, f"{g}·B",
              f"{DS} runtime/comm/coalesced_collectives.py:109-122", Phase.BACKWARD),
    ]
    # Gradients and optimizer states.
    grad_place = Location.GPU if opt is OffloadDevice.NONE else Location.HOST
    items.append(_item(f"{prec} gradient partition{' (pinned)' if grad_place is Location.HOST else ''}",
                       Category.GRADS, grad_place, g * qt, f"{g}{qsym}", f"{STAGE3}:791-796"))
    if opt is OffloadDevice.NONE:
        items += [
            _item("fp32 master partition", Category.MASTER_WEIGHTS, Location.GPU, FP32 * qt, f"4{qsym}",
                  f"{STAGE3}:1169-1172 (a copy, also in fp32 training)"),
            _item("Adam exp_avg + exp_avg_sq (fp32)", Category.OPTIMIZER, Location.GPU, ADAM_STATE_BYTES * qt,
                  f"8{qsym}", "ZeRO paper §3 (partitioned over N)"),
            _item("flat + fp32 gradient sub-group in step", Category.GRADS, Location.GPU,
                  max((g + FP32) * z.s, 8 * -(-z.largest_tensor // z.n)), f"max({g + FP32}S, 8⌈Lₜ/N⌉)",
                  f"{STAGE3}:2686-2687, 2456-2457", Phase.STEP),
        ]
        return items
    items += _offload_boundary_items(z, opt, device_is_host=device_is_host)
    if opt is OffloadDevice.CPU:
        items += [
            _item("fp32 master partition", Category.MASTER_WEIGHTS, Location.HOST, FP32 * qt, f"4{qsym}",
                  f"{STAGE3}:1157-1160"),
            _item("fp32 gradient partition (pinned)", Category.GRADS, Location.HOST, FP32 * qt, f"4{qsym}",
                  f"{STAGE3}:1337-1342"),
            _item("Adam exp_avg + exp_avg_sq (fp32)", Category.OPTIMIZER, Location.HOST, ADAM_STATE_BYTES * qt,
                  f"8{qsym}", "ZeRO-Offload (Ren et al. 2021)"),
        ]
        return items
    items += [
        _item("fp32 master partition (swapped)", Category.MASTER_WEIGHTS, Location.NVME, FP32 * qt, f"4{qsym}",
              f"{DS} swap_tensor/optimizer_utils.py:102-109"),
        _item("Adam exp_avg + exp_avg_sq (swapped)", Category.OPTIMIZER, Location.NVME, ADAM_STATE_BYTES * qt,
              f"8{qsym}", f"{DS} swap_tensor/optimizer_utils.py:256-283"),
        _item("fp32 gradient files", Category.GRADS, Location.NVME, FP32 * qt, f"4{qsym}",
              f"{DS} swap_tensor/optimizer_utils.py:256-283"),
        _item("optimizer swap buffers (buffer_count × S, fp32, page-locked)", Category.BUFFERS, Location.HOST,
              DEEPSPEED_OPTIMIZER_SWAP_BUFFERS * FP32 * z.s, "4·4S", f"{DS} swap_tensor/optimizer_utils.py:184-192"),
    ]
    return items


def _grad_of_module(z: _Sizes) -> LedgerItem:
    """The full gradient of the module backward is in, before its reduce-scatter: g·LL, or g·LLtr where part of
    the model is frozen (autograd makes no gradient for a frozen weight)."""
    sym = "LL" if z.full else "LLtr"
    return _item("full gradient of the module at hand", Category.BUFFERS, Location.GPU,
                 z.g * (z.largest_module if z.full else z.largest_module_grad), f"{z.g}·{sym}",
                 f"{DS} partition_parameters.py:1329-1346", Phase.BACKWARD)


def _prefetch_and_reuse(z: _Sizes, settings: ZeroSettings) -> list[LedgerItem]:
    """Without the traced replay: one prefetch bucket and the reuse window, each at most the model."""
    g = z.g
    return [
        _item(f"prefetched parameters (stage3_prefetch_bucket_size = {settings.prefetch_bucket_elements:,})",
              Category.BUFFERS, Location.GPU, g * min(settings.prefetch_bucket_elements, z.psi),
              f"{g}·prefetch", f"{DS} partitioned_param_coordinator.py:452-454", Phase.BACKWARD),
        _item(f"parameters kept for reuse (stage3_max_reuse_distance = {settings.max_reuse_distance:,})",
              Category.BUFFERS, Location.GPU, g * min(settings.max_reuse_distance, z.psi), f"{g}·reuse",
              f"{DS} partitioned_param_coordinator.py:634-664", Phase.BACKWARD)]


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
