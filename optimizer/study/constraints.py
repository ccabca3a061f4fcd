"""Which candidates DeepSpeed (and the study) can actually run — with the reason when not.

Rules, each from DeepSpeed's documentation or source (DeepSpeed 0.19, ``docs/_pages/config-json.md``
and ``runtime/zero/config.py``):

* ``offload_optimizer`` needs ZeRO stage ≥ 1 (the offload lives inside the ZeRO optimizer);
* ``offload_optimizer: nvme`` needs stage 3 (ZeRO-Infinity; stages 1–2 offload to CPU only);
* ``offload_param`` needs stage 3 (only stage 3 partitions parameters);
* the precision must be one the hardware supports (``hardware.supported_precisions``; for CPU ranks the
  default leaves fp16 out: DeepSpeed's CPU accelerator refuses it — "Type fp16 is not supported on your
  device" — unless oneDNN supports fp16 on that CPU, e.g. AVX512-FP16/AMX);
* the micro-batch must divide the global batch over the data-parallel ranks, since gradient
  accumulation is derived: ``global = micro × accumulation × ranks``;
* ``training.model_init: zero_init`` needs stage 3: ``deepspeed.zero.Init`` partitions the parameters as the
  model is built (``partition_parameters.py:1232-1262``), and only the stage-3 optimizer trains such a model;
* a 4-bit base (``model.quantization``) must be stored as the training dtype at ZeRO-3, which partitions its packed
  weights, and as uint8 or the training dtype below (DeepSpeed casts floating parameters,
  :meth:`optimizer.study.quantization_section.FourBitBase.storage_problem`);
* PEFT's fp32 adapters cannot train at ZeRO-3 in bf16/fp16 beside parameters of the training dtype (a
  ``modules_to_save`` copy, trained biases): :func:`mixed_trainable_dtypes`;
* a checkpointing option must make sense for the model: ``every_K`` needs K ≤ layers, and a
  seed-mode study must state an activation figure for the option.

Nothing here fixes a candidate: it returns reasons, and the caller reports them.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import metadata

from optimizer.study.knobs import (
    Candidate,
    EveryKCheckpointing,
    OffloadDevice,
    Precision,
    SelectiveCheckpointing,
    ZeroStage,
)
from optimizer.study.quantization_section import FourBitBase, bitsandbytes_missing
from optimizer.study.specs import (
    Construction,
    HardwareSpec,
    ModelInit,
    ModelSpec,
    SeedModel,
    TrainingSpec,
    TransformerModel,
)


def invalid_reasons(
    *, candidate: Candidate, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec
) -> tuple[str, ...]:
    """Every reason ``candidate`` cannot run on this study; empty when it is valid."""
    reasons: list[str] = []
    stage = candidate.zero_stage
    if candidate.offload_optimizer is not OffloadDevice.NONE and stage < ZeroStage.OPTIMIZER:
        reasons.append("offload_optimizer needs zero_stage >= 1 (DeepSpeed offloads inside the ZeRO optimizer)")
    if candidate.offload_optimizer is OffloadDevice.NVME and stage in (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS):
        reasons.append("offload_optimizer=nvme needs zero_stage 3 (ZeRO-Infinity); stages 1-2 offload to cpu only")
    if candidate.offload_param is not OffloadDevice.NONE and stage is not ZeroStage.PARAMETERS:
        reasons.append("offload_param needs zero_stage 3 (only stage 3 partitions parameters)")
    if candidate.precision not in hardware.supported_precisions:
        supported = ", ".join(p.value for p in hardware.supported_precisions)
        where = f"on these {hardware.accelerator} devices"
        if hardware.profile is not None and candidate.precision not in hardware.profile.precisions:
            where = f"by the {hardware.profile.name} profile"  # the device has no such precision (bf16 on a V100)
        reasons.append(f"precision={candidate.precision} is not supported {where} "
                       f"(hardware.supported_precisions: {supported})")
    if training.model_init is ModelInit.ZERO_INIT and stage is not ZeroStage.PARAMETERS:
        reasons.append(f"training.model_init=zero_init builds the model partitioned (deepspeed.zero.Init); zero_stage "
                       f"{int(stage)} cannot train a partitioned model (use model_init auto, device or full)")
    uses_nvme = OffloadDevice.NVME in (candidate.offload_optimizer, candidate.offload_param)
    if uses_nvme and hardware.nvme_path is None:
        reasons.append("NVMe offload needs hardware.nvme_path")
    per_step = candidate.micro_batch_size * hardware.world_size
    if training.global_batch_size % per_step:
        reasons.append(
            f"micro_batch_size={candidate.micro_batch_size} x {hardware.world_size} ranks = {per_step} "
            f"does not divide global_batch_size={training.global_batch_size}"
        )
    ckpt = candidate.checkpointing
    if isinstance(model, TransformerModel) and isinstance(ckpt, EveryKCheckpointing) and ckpt.k > model.layers:
        reasons.append(f"checkpointing={ckpt} checkpoints no block of a {model.layers}-layer model")
    if isinstance(model, TransformerModel) and model.hf_config is not None and isinstance(ckpt, SelectiveCheckpointing):
        reasons.append("checkpointing=selective: a transformers model recomputes whole layers only "
                       "(activation_checkpointing_enable); use full or every_K")
    if isinstance(model, TransformerModel) and model.quantization is not None:
        problem = FourBitBase.from_json(model.quantization).storage_problem(
            zero3=stage is ZeroStage.PARAMETERS, training_dtype=candidate.precision.torch_dtype_name)
        if problem:
            reasons.append(problem)
        missing = bitsandbytes_missing()
        if missing:
            reasons.append(missing)
    if isinstance(model, TransformerModel) and stage is ZeroStage.PARAMETERS:
        mixed = mixed_trainable_dtypes(model=model, candidate=candidate, training=training)
        if mixed:
            reasons.append(mixed)
    if isinstance(model, TransformerModel) and model.lm_head == "trl_fused" and not _installed("trl"):
        reasons.append("model.lm_head: trl_fused needs the trl package where trials run (pip install trl)")
    if isinstance(model, SeedModel) and model.activation_bytes_for(ckpt) is None:
        stated = ", ".join(sorted(model.activation_bytes))
        reasons.append(f"the study states no activation figure for checkpointing={ckpt} (stated: {stated})")
    return tuple(reasons)


def adapters_kept_fp32(*, model: TransformerModel, candidate: Candidate, training: TrainingSpec) -> bool:
    """PEFT's adapters stay fp32 in a 16-bit ZeRO-3 run of a model built under ``zero.Init``: ``get_peft_model``
    upcasts them (``autocast_adapter_dtype=True``, ``peft/tuners/tuners_utils.py:2729-2750``), and the engine casts
    parameters to the training dtype only when the model was not built by zero.Init (``engine.py:1859-1862``,
    ``is_zero_init_model``). Their partitions then sit in an fp32 flat buffer (``defragment`` keeps the one dtype of
    the trainable group, ``runtime/zero/utils.py:215-243``) and the persistent ones are gathered whole in fp32.
    A 4-bit base is built without zero.Init (``modeling_utils.py:1435``): the engine casts its adapters."""
    return (candidate.zero_stage is ZeroStage.PARAMETERS and candidate.precision is not Precision.FP32
            and zero3_keeps_adapters_fp32(model=model, training=training))


def zero3_keeps_adapters_fp32(*, model: TransformerModel, training: TrainingSpec) -> bool:
    """Whether a 16-bit ZeRO-3 run of this study leaves PEFT's adapters fp32 (:func:`adapters_kept_fp32` for any
    such candidate): the model is built under zero.Init and has no 4-bit base. Its traces ask the same
    (``launchers/trace/study_traces.py``)."""
    return model.quantization is None and training.construction(ZeroStage.PARAMETERS) is Construction.ZERO_INIT


def mixed_trainable_dtypes(*, model: TransformerModel, candidate: Candidate, training: TrainingSpec) -> str | None:
    """Why DeepSpeed cannot train this PEFT model at ZeRO-3, or None: its fp32 adapters (:func:`adapters_kept_fp32`)
    train beside parameters in the training dtype — ``modules_to_save`` copies, biases ``bias: all``/``lora_only``
    trains. ZeRO-3 moves every trainable partition into one flat buffer of one dtype (``stage3.py:966-972``;
    ``defragment`` asserts it, ``runtime/zero/utils.py:218``), so ``deepspeed.initialize`` fails; with
    ``offload_param`` the flat buffers are per group and the first forward fails instead, on an fp32 weight meeting
    a 16-bit input (both measured on CPU ranks, DeepSpeed 0.19.8, PEFT 0.21: test_mixed_trainable_dtypes_real;
    reported as TRL#1770, LlamaFactory#2774). Without an inventory (the model could not be built on fake tensors)
    the setup's own fields decide."""
    if model.peft is None or not adapters_kept_fp32(model=model, candidate=candidate, training=training):
        return None
    named = _trained_beside_adapters(model)
    if named is None:
        return None
    where = ("at the first forward (offload_param: an fp32 weight meets a 16-bit input)"
             if candidate.offload_param is not OffloadDevice.NONE else
             "at deepspeed.initialize (runtime/zero/utils.py:218)")
    return (f"zero_stage=3 with precision={candidate.precision} cannot train PEFT's fp32 adapters beside {named} in "
            f"{candidate.precision} (model.peft: modules_to_save or bias): DeepSpeed's ZeRO-3 holds trainable "
            f"parameters in flat buffers of one dtype and fails {where}; use zero_stage <= 2, precision fp32, or "
            f"training.model_init: full (the engine then casts the adapters)")


@lru_cache(maxsize=64)
def _trained_beside_adapters(model: TransformerModel) -> str | None:
    """What trains in the training dtype beside PEFT's adapters, named (the inventory's tensors; without one, the
    setup's ``modules_to_save`` and ``bias``), or None. Cached: ``invalid_reasons`` asks per candidate."""
    if model.inventory is not None:
        tensors = model.inventory.tensors
        others = [t.name for t in tensors if t.trainable and not t.adapter]
        if not others or not any(t.adapter and t.trainable for t in tensors):
            return None
        return ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    fields = json.loads(model.peft or "{}")
    named = " and ".join(part for part in (
        "the modules_to_save copies" if fields.get("modules_to_save") else "",
        "the biases it trains" if fields.get("bias", "none") != "none" else "") if part)
    return named or None


def _installed(package: str) -> bool:
    """Whether ``package`` is installed here (its metadata; nothing is imported)."""
    try:
        metadata.version(package)
    except metadata.PackageNotFoundError:
        return False
    return True


def gradient_accumulation_steps(*, candidate: Candidate, hardware: HardwareSpec, training: TrainingSpec) -> int:
    """Accumulation steps that keep the global batch fixed; the candidate must be valid."""
    per_step = candidate.micro_batch_size * hardware.world_size
    if training.global_batch_size % per_step:
        raise ValueError(f"micro-batch {candidate.micro_batch_size} does not divide the global batch")
    return training.global_batch_size // per_step
