"""What a trial measured of the device, turned into the figures a study plans with (pure).

Two figures of ``hardware`` are the device's own, and a trial measures both (docs/trials.md, "Device memory as the
device sees it"):

* **The device reserve** — memory outside PyTorch's caching allocator: the CUDA context, NCCL's buffers, cuBLAS
  handles. A study that does not state ``hardware.device_reserve`` plans with the published CUDA default (1 GiB,
  :data:`optimizer.study.hardware_section.CUDA_DEVICE_RESERVE_BYTES`) until a trial has measured it
  (:func:`measured_device_reserve`), then with the measurement; a stated reserve always wins.
* **The capacity** — ``torch.cuda.get_device_properties(i).total_memory``, what CUDA can allocate on the device
  (an "80 GB" H100 reports 79.2 GiB). The study plans with the smaller of its ``gpu_memory`` and that
  (:func:`capacity_budget`): a smaller ``gpu_memory`` is a budget, a larger one memory that is not there.

:func:`planning_spec` applies both; :mod:`optimizer.search.device_attrs` keeps the measurements on the study.
"""

from __future__ import annotations

import dataclasses

from optimizer.results.trial_result import TrialResult
from optimizer.study.errors import UserError
from optimizer.study.specs import HardwareSpec
from optimizer.study.study_file import StudySpec
from optimizer.study.units import format_bytes


def measured_device_reserve(result: TrialResult) -> int | None:
    """The device reserve a trial measured: the largest use outside PyTorch's pool (device used − reserved) of any
    rank, read after ``deepspeed.initialize`` or at the largest training reading, whichever is more (bytes).

    The init reading holds the CUDA context and the NCCL communicators DeepSpeed's initialize set up; the training
    one adds what the first steps load (cuBLAS handles, kernels loaded lazily, the communicators of later
    collectives) — the ledger adds the reserve to both phases, so the larger serves both. None where nothing was
    measured (CPU ranks, a failure before init, no reader) or the figure is not positive (a reader that did not see
    this process's own use)."""
    figures = [f for f in (result.device_non_torch_init_bytes, result.device_non_torch_peak_bytes) if f is not None]
    reserve = max(figures) if figures else None
    return reserve if reserve is not None and reserve > 0 else None


def with_measured_reserve(spec: StudySpec, *, measured_reserve_bytes: int | None) -> StudySpec:
    """The spec to plan with: a stated ``hardware.device_reserve`` always wins; the default is replaced by
    ``measured_reserve_bytes`` (None: nothing measured yet, the default stays). ``device_reserve_stated`` stays
    False, so output still says the study did not state it. UserError: the measured reserve leaves nothing of
    ``gpu_memory``."""
    hardware = spec.hardware
    if hardware.device_reserve_stated or measured_reserve_bytes is None:
        return spec
    if measured_reserve_bytes >= hardware.gpu_memory_bytes:
        binary = hardware.binary_units
        raise UserError(source=str(spec.path), key="hardware.gpu_memory", why=(
            f"a trial measured {format_bytes(measured_reserve_bytes, binary=binary)} of device memory outside "
            f"PyTorch's allocator (CUDA context, NCCL buffers), which leaves nothing of "
            f"{format_bytes(hardware.gpu_memory_bytes, binary=binary)}: raise gpu_memory, or state "
            "hardware.device_reserve"))
    measured = dataclasses.replace(hardware, device_reserve_bytes=measured_reserve_bytes)
    return dataclasses.replace(spec, hardware=measured)


def capacity_budget(hardware: HardwareSpec, *, measured_total_bytes: int | None) -> int:
    """The device memory to plan with: the smaller of the study's ``gpu_memory`` and the device's measured
    ``total_memory`` (bytes; None: not measured yet, the study's figure)."""
    if measured_total_bytes is None:
        return hardware.gpu_memory_bytes
    return min(hardware.gpu_memory_bytes, measured_total_bytes)


def capacity_note(hardware: HardwareSpec, *, measured_total_bytes: int | None) -> str | None:
    """One line when the study's ``gpu_memory`` is more than the device has ("the study says 80.00 GiB; the device
    has 79.19 GiB ..."), in the study's unit family; None otherwise."""
    if measured_total_bytes is None or hardware.gpu_memory_bytes <= measured_total_bytes:
        return None
    binary = hardware.binary_units
    return (f"hardware.gpu_memory says {format_bytes(hardware.gpu_memory_bytes, binary=binary)}; the device has "
            f"{format_bytes(measured_total_bytes, binary=binary)} (torch.cuda.get_device_properties().total_memory): "
            "planning with the device's")


def planning_spec(spec: StudySpec, *, measured_reserve_bytes: int | None,
                  measured_total_bytes: int | None) -> StudySpec:
    """The spec to plan with, both measurements applied: ``gpu_memory`` cut to the device's capacity
    (:func:`capacity_budget`), then the measured reserve in place of the default (:func:`with_measured_reserve`).
    The same spec back when neither changes anything."""
    budget = capacity_budget(spec.hardware, measured_total_bytes=measured_total_bytes)
    if budget != spec.hardware.gpu_memory_bytes:
        if spec.hardware.device_reserve_bytes >= budget:
            raise UserError(source=str(spec.path), key="hardware.device_reserve", why=(
                f"{format_bytes(spec.hardware.device_reserve_bytes, binary=spec.hardware.binary_units)} is not "
                f"below the device's {format_bytes(budget, binary=spec.hardware.binary_units)}"))
        spec = dataclasses.replace(spec, hardware=dataclasses.replace(spec.hardware, gpu_memory_bytes=budget))
    return with_measured_reserve(spec, measured_reserve_bytes=measured_reserve_bytes)
