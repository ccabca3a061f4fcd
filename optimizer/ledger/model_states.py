"""Transformer-mode ledger items: what DeepSpeed 0.19.8 actually allocates, per rank (pure).

Read from DeepSpeed's source (``runtime/engine.py``, ``runtime/zero/stage_1_and_2.py``,
``runtime/zero/stage3.py``, ``runtime/fp16/fused_optimizer.py``, ``runtime/swap_tensor/``) and
checked tensor by tensor on CPU ranks; file:line references are to DeepSpeed 0.19.8. Symbols:

* Ψ parameters, Ψtr of them trainable and Ψ − Ψtr frozen (PEFT's base, ``training.frozen``; Ψtr = Ψ for a
  full fine-tune), N data-parallel ranks, g bytes per element of the training dtype (fp32 4,
  bf16/fp16 2; DeepSpeed's gradient-accumulation and communication dtypes default to it);
* P = Ψ₁₂/N, the ZeRO-1/2 partition, Ψ₁₂ = Ψtr padded to a multiple of 2N (``stage_1_and_2.py:387,441``: the flat
  group holds the trainable tensors only, ``:428-434``);
* Σ = the worst rank's P widened to whole tensors at both edges of its range, from the model's parameter order
  (``grads_in_partition``, ``stage_1_and_2.py:2184-2194``; :func:`optimizer.ledger.transformer.zero12_partition`),
  Lₚ the largest part of one tensor inside one rank's range (≤ min(Lₜ, P)), Lₜ the largest parameter tensor;
* Q = Σₚ ⌈nₚ/N⌉, the ZeRO-3 partition of every tensor, frozen ones too (``partition_parameters.py:1690-1696``),
  Qtr the same over the trainable tensors (gradients, master weights, states: ``stage3.py:726-745``);
  S = min(Qtr, sub_group_size);
* Lₜ the largest trainable tensor (the gradient buffers' size; the largest tensor in a full fine-tune), K persistent
  (never partitioned) elements, LL the largest module (gathered whole, frozen weights too), LLtr the most trainable
  elements of one module (the module's full gradient), B the reduce bucket, T the tied weights' extra copies a
  model is built with before they are tied (elements).

Frozen tensors get no gradient, master copy or optimizer state at any stage; they are cast to the training dtype
with the rest of the module (``engine.py:1851-1862``) and, below ZeRO-3, held whole on every rank outside the flat
group (``engine.py:2093``); ZeRO-3 partitions and gathers them like any parameter (docs/ledger.md, "Trainable and
frozen").

Model states in mixed precision are the ZeRO paper's 2Ψ + 2Ψ + 12Ψ (16 bytes per parameter) and
DeepSpeed's estimator's 2Ψ + 18Ψ/N at ZeRO-2 (``stage_1_and_2.py:4017-4033``) — with what the estimators
leave out written in: ZeRO-1/2/3 keep a separate FP32 master partition *even in FP32 training*
(``stage_1_and_2.py:560`` clones; ``stage3.py:1162-1172``'s alias is dead code), the buckets, the step's
transient FP32 gradient copy, and ZeRO-3's persistent small parameters and gathered modules.
"""

from __future__ import annotations

from dataclasses import replace

from optimizer.deepspeed.zero_settings import ZeroSettings, zero_settings
from optimizer.ledger.activations import activation_items, joint_trace, usable_trace
from optimizer.ledger.four_bit_items import dequantized_items, held_items
from optimizer.ledger.init_phase import construction_moments, init_items, init_moments, moment_bytes, parameter_location
from optimizer.ledger.items import Category, LedgerItem, Location, Phase
from optimizer.ledger.reference import reference_items
from optimizer.ledger.state_sizes import (
    ADAM_STATE_BYTES,
    DS,
    FP32,
    STAGE0_ALLREDUCE_ELEMENTS,
    STAGE12,
    _item,
    _Sizes,
    _sizes,
)
from optimizer.ledger.transformer import largest_tensor_parameters
from optimizer.ledger.zero3_states import _stage3, gathers
from optimizer.study.knobs import Candidate, OffloadDevice, Precision, ZeroStage
from optimizer.study.specs import Accelerator, HardwareSpec, TrainingSpec, TransformerModel

__all__ = ["DS", "_Sizes", "_stage3", "_stage12", "construction_bytes", "transformer_items"]


def _stage0(z: _Sizes, precision: Precision, *, joined: bool, gloo: bool) -> list[LedgerItem]:
    """Stage 0: FusedAdam directly (fp32), or ``FP16_Optimizer`` with a flat FP32 master (bf16/fp16). With
    ``joined`` the gradients autograd makes during backward are in the traced joint line, so the full ones are
    counted after backward only (``engine.py:3495-3500`` sets every ``.grad`` to None after the step). The whole
    module is cast (g·Ψ); gradients, the flatten, master weights and states cover the trainable Ψtr alone
    (autograd makes no ``.grad`` for a frozen tensor; the optimizer holds what dsopt, as HF Trainer, passes it:
    the parameters that require a gradient)."""
    g, psi, t, sym = z.g, z.psi, z.trainable, z.psi_tr
    flatten = g * min(t, STAGE0_ALLREDUCE_ELEMENTS + z.largest_tensor)
    grads = [_item(f"{precision} gradients", Category.GRADS, Location.GPU, g * t, f"{g}{sym}",
                   f"{DS} engine.py (autograd)", phase) for phase in ((Phase.REDUCE, Phase.STEP) if joined
                                                                      else (Phase.ALWAYS,))]
    items = [
        _item(f"{precision} parameters", Category.PARAMS, Location.GPU, g * (psi - z.four_bit),
              f"{g}(Ψ − Ψ₄)" if z.four_bit else f"{g}Ψ", f"{DS} engine.py"),
        *grads,
        _item("Adam exp_avg + exp_avg_sq (fp32)", Category.OPTIMIZER, Location.GPU, ADAM_STATE_BYTES * t, f"8{sym}",
              "ZeRO paper §3; fused_adam.py:153-157"),
        _item("allreduce flatten (≤ 5e8 + Lₜ elements)", Category.BUFFERS, Location.GPU, flatten,
              f"{g}·min({sym}, 5e8 + Lₜ)", f"{DS} engine.py:3073-3095 (MEMORY_OPT_ALLREDUCE_SIZE)", Phase.REDUCE),
    ]
    if gloo:  # gloo's work object holds the flattened tensor and may drop it on its own thread after the step
        # began: the same candidate measured 3.94 and 4.27 MB in runs of 2 ranks and of 1, 2Ψ apart (docs/ledger.md)
        items.append(replace(_item("allreduce flatten, freed late on gloo's thread", Category.BUFFERS, Location.GPU,
                                   flatten, f"{g}·min({sym}, 5e8 + Lₜ)", f"{DS} engine.py:3073-3095; gloo",
                                   Phase.STEP), sometimes=True))
    if precision is not Precision.FP32:
        items += [
            _item("fp32 master weights (flat)", Category.MASTER_WEIGHTS, Location.GPU, FP32 * t, f"4{sym}",
                  f"{DS} runtime/fp16/fused_optimizer.py:100"),
            _item("fp32 gradient list + flat copy in step", Category.GRADS, Location.GPU, 2 * FP32 * t, f"8{sym}",
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
    sym = z.psi_tr
    items = [
        _item(f"{prec} parameters (flat, full)", Category.PARAMS, Location.GPU, g * z.padded, f"{g}{sym}",
              f"{STAGE12}:505-509"),
        _item(f"gradient bucket{'s' if buckets > 1 else ''} (reduce_bucket_size = {z.bucket:,})", Category.BUFFERS,
              Location.GPU, buckets * g * z.bucket, f"{buckets}·{g}·B", f"{STAGE12}:3266-3278",
              Phase.ALWAYS if stage1 else Phase.BACKWARD),
    ]
    if z.frozen > z.four_bit:  # not in the flat group (:428-434): left in the module, cast and moved with it,
        # whole on every rank (a QLoRA base's 4-bit weights: optimizer/ledger/four_bit_items.py)
        items.append(_item(f"frozen {prec} parameters (whole on every rank)", Category.PARAMS, Location.GPU,
                           g * (z.frozen - z.four_bit), f"{g}(Ψ − Ψtr − Ψ₄)" if z.four_bit else f"{g}(Ψ − Ψtr)",
                           f"{STAGE12}:428-434; {DS} engine.py:1851-1862, 2093"))
    if gloo:
        # all_gather_dp_groups (runtime/utils.py) into the flat parameters: over gloo the profiled ranks allocated
        # a tensor of the whole flat group under c10d::_allgather_base_ (benchmarks/peak_attribution.py).
        items.append(_item(f"{prec} all-gathered parameters (gloo's output tensor)", Category.BUFFERS, Location.GPU,
                           g * z.padded, f"{g}{sym}", f"{STAGE12}:3155-3158 (all_gather_dp_groups); gloo",
                           Phase.GATHER))
    if stage1:
        # Full low-precision gradients until the boundary reduction clears them (:1067).
        for phase in (Phase.REDUCE,) if joined else (Phase.BACKWARD, Phase.REDUCE):
            items.append(_item(f"{prec} gradients (full, until reduced)", Category.GRADS, Location.GPU,
                               g * z.trainable, f"{g}{sym}", f"{STAGE12}:1067", phase))
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


def construction_bytes(*, candidate: Candidate, model: TransformerModel, hardware: HardwareSpec,
                       training: TrainingSpec) -> int:
    """Per-rank device bytes (CPU ranks: device + host) at the peak of building the model alone, before
    ``deepspeed.initialize`` (:func:`optimizer.ledger.init_phase.construction_moments`)."""
    settings = zero_settings(model=model, stage=candidate.zero_stage)
    z = _sizes(model=model, candidate=candidate, hardware=hardware, training=training, settings=settings)
    moments = construction_moments(
        construction=training.construction(candidate.zero_stage), precision=candidate.precision, g=z.g, psi=z.psi,
        q=z.q, largest_module=z.largest_module, tied=z.tied,
        param_place=parameter_location(candidate.offload_param), four_bit=z.four_bit, four_bit_bytes=z.four_bit_bytes)
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
    # ZeRO-3: where the trace says when parameters are gathered and what is live then, one moment holds both
    zero3_joint = traced.zero3_joint_at(candidate.micro_batch_size) \
        if stage is ZeroStage.PARAMETERS and traced is not None and gathers(z, candidate) else None
    split = stage is ZeroStage.GRADIENTS and traced is not None and bool(traced.split_points)
    if stage is ZeroStage.DISABLED:
        items = _stage0(z, candidate.precision, joined=joined,  # one rank all-reduces too (engine.py:3153-3165)
                        gloo=hardware.accelerator is Accelerator.CPU)
    elif stage is ZeroStage.PARAMETERS:
        items = _stage3(z, candidate, settings, replayed=traced.zero3_gathered if traced is not None else 0,
                        joint_bytes=zero3_joint[1] if zero3_joint is not None else None,
                        autograd_bytes=zero3_joint[2] if zero3_joint is not None else 0,
                        autograd_held=traced.zero3_autograd_held if traced is not None else 0,
                        device_is_host=hardware.accelerator is Accelerator.CPU)
    else:
        items = _stage12(z, candidate, settings, joined=joined, split=split,
                         gloo=hardware.accelerator is Accelerator.CPU)

    items += held_items(z, candidate)
    if traced is None:  # a trace holds the dequantized weights where they happen (launchers/models/four_bit.py)
        items += dequantized_items(model, candidate, split=split)
    items += reference_items(z, candidate, settings, model,
                             joint_bytes=zero3_joint[3] if zero3_joint is not None else None)
    items += activation_items(model=model, candidate=candidate, sequence_length=training.sequence_length,
                              element_bytes=z.g, joined=joined, split=split,
                              zero3_joint=zero3_joint is not None)
    moments = init_moments(candidate=candidate, construction=training.construction(stage), psi=z.psi,
                           padded=z.padded, p=z.p, q=z.q, s=z.s, largest_tensor=z.largest_tensor,
                           largest_module=z.largest_module, tied=z.tied, bucket=z.bucket, trainable=z.trainable,
                           q_trainable=z.q_trainable, largest_cast=largest_tensor_parameters(model),
                           four_bit=z.four_bit, four_bit_bytes=z.four_bit_bytes,
                           device_bytes=None if hardware.accelerator is Accelerator.CPU
                           else hardware.gpu_memory_bytes - hardware.device_reserve_bytes)
    items += init_items(moments, device_is_host=hardware.accelerator is Accelerator.CPU)
    return items
