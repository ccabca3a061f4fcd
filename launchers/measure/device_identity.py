"""Which device a trial rank ran on: its CUDA name and total memory, for the rank report.

The study loop compares them with the study's ``hardware.profile``
(:func:`optimizer.study.hardware_profiles.profile_mismatch`), so speed figures for one GPU are not silently
used on another. ``torch.cuda.get_device_name`` and ``torch.cuda.get_device_properties(dev).total_memory``
are PyTorch's (``torch/cuda/__init__.py``); CPU ranks report None for both. The total is also the device's real
capacity: a study plans with the smaller of it and its ``gpu_memory``
(:func:`optimizer.results.device_budget.capacity_budget`).
"""

from __future__ import annotations

import os
from typing import Any

import torch


def cuda_rank() -> bool:
    """Whether this rank runs on CUDA: a device is there and the launch did not set ``DS_ACCELERATOR=cpu``
    (:func:`launchers.trial.local.build_launch_plan` sets it both ways). The one decision every rank program makes."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"


def device_identity(*, cuda: bool) -> dict[str, Any]:
    """``{"device_name": ..., "device_total_bytes": ...}`` of this rank's current CUDA device (None on CPU ranks,
    or where CUDA cannot answer — a rank that failed in CUDA itself still writes its report)."""
    if not cuda:
        return {"device_name": None, "device_total_bytes": None}
    try:
        device = torch.cuda.current_device()
        return {"device_name": str(torch.cuda.get_device_name(device)),
                "device_total_bytes": int(torch.cuda.get_device_properties(device).total_memory)}
    except Exception:  # a courtesy: a broken CUDA must not lose the failure's report
        return {"device_name": None, "device_total_bytes": None}
