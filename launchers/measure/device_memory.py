"""This rank's device memory as the device sees it: the CUDA context, NCCL's buffers and cuBLAS included.

PyTorch's ``max_memory_allocated`` / ``max_memory_reserved`` count its caching allocator only; the device also holds
the CUDA context (the kernels loaded), NCCL's buffers and the cuBLAS handles. This module reads what the driver says
the process holds, by the first of three readers that answers (docs/trials.md, "Device memory as the device sees
it"; sources in docs/sources.md):

1. ``nvml_process`` — NVML's figure for this process: ``nvmlDeviceGetComputeRunningProcesses(handle)``, the entry
   whose ``pid`` is ``os.getpid()``; its ``usedGpuMemory`` is "all of the memory used by the application" (NVML API
   reference). Other processes on the device do not matter.
2. ``nvml_device`` — NVML's device figure less the one read before this process touched CUDA:
   ``nvmlDeviceGetMemoryInfo(handle).used`` now − then. For a container whose PID namespace hides the host pids NVML
   reports (the driver knows no PID namespaces: NVIDIA/nvidia-docker#1483), or an entry without ``usedGpuMemory``.
   Assumes nothing else changed its use of the device meanwhile — true when no other process runs on it: dsopt gives
   every rank its own device and workers disjoint slots (``dsopt worker --slot``); overlapping slots break it.
3. ``cuda_mem_get_info`` — without ``pynvml`` (package ``nvidia-ml-py``, the ``gpu`` extra):
   ``torch.cuda.mem_get_info`` (``cudaMemGetInfo``), total − free. That call needs the context it would measure, so
   no reading exists from before the process touched CUDA: the whole device's use counts as this rank's — exact on a
   device that is this rank's alone (the assumption of 2), more than the rank's own otherwise (the safe side).

The reader that answers first is kept for the rank's later samples, so its figures compare with each other. The NVML
device is found by the CUDA device's UUID (``torch.cuda.get_device_properties(i).uuid``, without NVML's ``GPU-`` or
``MIG-`` prefix), which holds under ``CUDA_VISIBLE_DEVICES`` and MIG, where NVML's own indices do not.

Neither NVML nor ``cudaMemGetInfo`` keeps a peak: they give the use at the moment asked. The rank samples where it
reads its PyTorch peaks — after ``deepspeed.initialize`` (init), after every attempted step, at the end — and each
sample also reads ``torch.cuda.memory_reserved()`` (PyTorch's pool at that moment); ``used − reserved`` is what is
outside PyTorch's pool: the device reserve the ledger adds (:mod:`optimizer.results.device_budget`). The training
figure is the sample with the most used: a lower bound of the device's true peak (within a step activations come and
go; the caching allocator keeps its pool between steps unless emptied, memory outside it need not stay).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch

NVML_PROCESS = "nvml_process"
"""The figures are NVML's for this process (its pid found on the device)."""
NVML_DEVICE = "nvml_device"
"""The figures are NVML's device use less the use before this process touched CUDA."""
CUDA_MEM_GET_INFO = "cuda_mem_get_info"
"""The figures are the device's whole use by ``cudaMemGetInfo`` (no NVML)."""
READERS = (NVML_PROCESS, NVML_DEVICE, CUDA_MEM_GET_INFO)
"""The readers, in the order they are tried."""
EMPTY = {"device_memory_source": None, "device_used_init_bytes": None, "device_non_torch_init_bytes": None,
         "device_used_peak_bytes": None, "device_non_torch_peak_bytes": None}
"""The rank report's fields where nothing was measured (CPU ranks; a CUDA device no reader could read)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSample:
    """One moment's reading."""

    used_bytes: int
    """The process's use of the device, as the reader gives it (bytes)."""
    reserved_bytes: int
    """``torch.cuda.memory_reserved()`` at the same moment: PyTorch's caching allocator's pool (bytes)."""

    @property
    def non_torch_bytes(self) -> int:
        """Used − reserved: what the device holds for this process outside PyTorch's pool (bytes)."""
        return self.used_bytes - self.reserved_bytes


def _import_pynvml() -> Any | None:
    """The ``pynvml`` module (package ``nvidia-ml-py``), initialised, or None: not installed, or no driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_DriverNotLoaded, LibraryNotFound, ...: no NVML, the next reader answers
        return None
    return pynvml


def _nvml_handle(nvml: Any, index: int) -> Any | None:
    """NVML's handle of CUDA device ``index``, by its UUID (a GPU, or a MIG instance), or None."""
    try:
        bare = str(torch.cuda.get_device_properties(index).uuid)  # cudaGetDeviceProperties: creates no context
    except Exception:
        return None
    bare = bare.removeprefix("GPU-").removeprefix("MIG-")
    for prefix in ("GPU-", "MIG-"):
        try:
            return nvml.nvmlDeviceGetHandleByUUID(prefix + bare)
        except Exception:  # NVMLError_NotFound: try the other namespace
            continue
    return None


class DeviceMemory:
    """One rank's device-memory readings: opened before the process touches CUDA, sampled, then reported."""

    def __init__(self, *, index: int | None, nvml: Any = None, handle: Any = None,
                 before_bytes: int | None = None) -> None:
        self.index = index
        """The CUDA device index (None: a CPU rank, nothing to read)."""
        self.nvml = nvml
        self.handle = handle
        self.before_bytes = before_bytes
        """NVML's device use before this process touched CUDA (bytes; None: no NVML)."""
        self.source: str | None = None
        """The reader that answered first (:data:`READERS`), kept for every later sample."""
        self.init: DeviceSample | None = None
        self.peak: DeviceSample | None = None

    @classmethod
    def open(cls, *, cuda: bool, index: int) -> DeviceMemory:
        """Call before this process touches CUDA device ``index``: NVML's reading of the device then is the
        ``nvml_device`` reader's baseline. CPU ranks (``cuda`` False) get a reader that reads nothing."""
        if not cuda:
            return cls(index=None)
        nvml = _import_pynvml()
        handle = None if nvml is None else _nvml_handle(nvml, index)
        before = None
        if handle is not None:
            try:
                before = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except Exception:
                before = None
        return cls(index=index, nvml=nvml, handle=handle, before_bytes=before)

    def _read(self, source: str) -> int | None:
        if source == NVML_PROCESS and self.handle is not None:
            pid = os.getpid()
            for process in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if process.pid == pid:
                    return None if process.usedGpuMemory is None else int(process.usedGpuMemory)
            return None  # not listed: a PID namespace hides it
        if source == NVML_DEVICE and self.handle is not None and self.before_bytes is not None:
            return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used) - self.before_bytes
        if source == CUDA_MEM_GET_INFO:
            free, total = torch.cuda.mem_get_info(self.index)
            return int(total) - int(free)
        return None

    def used_bytes(self) -> int | None:
        """The process's use of the device now, by the kept reader or the first that answers (None: none does)."""
        if self.index is None:
            return None
        for source in (self.source,) if self.source else READERS:
            try:
                used = self._read(source)
            except Exception:  # a courtesy: a measurement must not fail the trial
                used = None
            if used is not None:
                self.source = source
                return used
        return None

    def sample(self, *, init: bool = False) -> None:
        """Read now: the init phase's figure (``init``), or a training moment (the one with the most used is kept)."""
        used = self.used_bytes()
        if used is None:
            return
        reading = DeviceSample(used_bytes=used, reserved_bytes=int(torch.cuda.memory_reserved(self.index)))
        if init:
            self.init = reading
        elif self.peak is None or reading.used_bytes > self.peak.used_bytes:
            self.peak = reading

    def report(self) -> dict[str, Any]:
        """The rank report's fields (:data:`EMPTY`'s keys), and NVML shut down (nvmlInit/nvmlShutdown are counted)."""
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
            self.nvml = None
        if self.source is None:
            return dict(EMPTY)
        init, peak = self.init, self.peak
        return {"device_memory_source": self.source,
                "device_used_init_bytes": None if init is None else init.used_bytes,
                "device_non_torch_init_bytes": None if init is None else init.non_torch_bytes,
                "device_used_peak_bytes": None if peak is None else peak.used_bytes,
                "device_non_torch_peak_bytes": None if peak is None else peak.non_torch_bytes}
