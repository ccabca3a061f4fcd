"""The DeepSpeed JSON boundary: candidate + specs → the DeepSpeed config dict (pure).

One function, used by the trial launcher and (later) by export. Keys and defaults follow DeepSpeed's
``docs/_pages/config-json.md`` and ``runtime/zero/config.py`` (0.19.8):

* batch: ``train_batch_size`` = global batch, ``train_micro_batch_size_per_gpu`` = the knob,
  ``gradient_accumulation_steps`` derived so the global batch stays fixed;
* ``zero_optimization``: the stage, and the bucket/prefetch sizes of :mod:`optimizer.deepspeed.zero_settings`
  (the ledger counts exactly these buffers); ``offload_optimizer`` / ``offload_param`` sections
  with ``pin_memory`` and, for NVMe, ``nvme_path``;
* ``bf16`` / ``fp16`` sections (fp16 with dynamic loss scaling, DeepSpeed's defaults written out);
* the optimizer: DeepSpeed's own ``Adam``/``AdamW`` (with offload DeepSpeed swaps in DeepSpeedCPUAdam).
"""

from __future__ import annotations

from typing import Any

from optimizer.deepspeed.zero_settings import zero_settings
from optimizer.study.constraints import gradient_accumulation_steps
from optimizer.study.knobs import Candidate, OffloadDevice, Precision, ZeroStage
from optimizer.study.specs import HardwareSpec, ModelSpec, Optimizer, SeedModel, TrainingSpec

STEPS_PER_PRINT = 10**9
"""DeepSpeed's progress printing, effectively off: trials report their own figures."""


def _offload_section(device: OffloadDevice, *, nvme_path: str | None) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device.value, "pin_memory": True}
    if device is OffloadDevice.NVME:
        if nvme_path is None:
            raise ValueError("NVMe offload needs hardware.nvme_path")
        section["nvme_path"] = nvme_path
    return section


def build_ds_config(
    *, candidate: Candidate, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec
) -> dict[str, Any]:
    """The DeepSpeed config for ``candidate`` (which must be valid; see :mod:`optimizer.study.constraints`)."""
    if isinstance(model, SeedModel):
        raise ValueError("a seed-mode model has no shape to run; give the study a transformer model")
    stage = candidate.zero_stage
    settings = zero_settings(model=model, stage=stage)
    zero: dict[str, Any] = {
        "stage": int(stage),
        "contiguous_gradients": settings.contiguous_gradients,
        "overlap_comm": settings.overlap_comm,
        "reduce_bucket_size": settings.reduce_bucket_elements,
    }
    if stage in (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS):
        zero["allgather_bucket_size"] = settings.allgather_bucket_elements
    if stage is ZeroStage.PARAMETERS:
        zero.update(
            stage3_prefetch_bucket_size=settings.prefetch_bucket_elements,
            stage3_param_persistence_threshold=settings.param_persistence_threshold,
            stage3_max_reuse_distance=settings.max_reuse_distance,
            stage3_max_live_parameters=settings.max_live_parameters,
            sub_group_size=settings.sub_group_size,
        )
    if candidate.offload_optimizer is not OffloadDevice.NONE:
        zero["offload_optimizer"] = _offload_section(candidate.offload_optimizer, nvme_path=hardware.nvme_path)
    if candidate.offload_param is not OffloadDevice.NONE:
        zero["offload_param"] = _offload_section(candidate.offload_param, nvme_path=hardware.nvme_path)

    config: dict[str, Any] = {
        "train_batch_size": training.global_batch_size,
        "train_micro_batch_size_per_gpu": candidate.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps(
            candidate=candidate, hardware=hardware, training=training),
        "optimizer": {
            "type": "AdamW" if training.optimizer is Optimizer.ADAMW else "Adam",
            "params": {"lr": training.learning_rate, "betas": [0.9, 0.999], "eps": 1e-8,
                       "weight_decay": training.weight_decay},
        },
        "zero_optimization": zero,
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if candidate.precision is Precision.BF16:
        config["bf16"] = {"enabled": True}
    elif candidate.precision is Precision.FP16:
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}
    return config
