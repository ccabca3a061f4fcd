"""The rank's device-memory reader (launchers/measure/device_memory.py) against FAKES: a fake ``pynvml`` module put in
``sys.modules`` and fake ``torch.cuda`` functions (monkeypatched). No GPU here: these check the reader's logic —
which reader answers, the pid match and its fallbacks, the arithmetic — not what a driver reports. Figures by hand.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from launchers.measure import device_memory
from launchers.measure.device_memory import (
    CUDA_MEM_GET_INFO,
    EMPTY,
    NVML_DEVICE,
    NVML_PROCESS,
    DeviceMemory,
)

MiB = 2**20
GiB = 2**30
BARE_UUID = "8a1b2c3d-0000-1111-2222-333344445555"
"""``str(torch.cuda.get_device_properties(i).uuid)``: the UUID without NVML's ``GPU-``/``MIG-`` prefix."""
OTHER_PID = 4242
"""A pid NVML lists that is not this process (a host pid, as NVML gives them inside a container)."""


class FakeNVMLError(Exception):
    """Stands for pynvml.NVMLError."""


class FakeProcess:
    """Stands for pynvml's friendly nvmlProcessInfo object (``pid``, ``usedGpuMemory``; None: not available)."""

    def __init__(self, pid: int, used: int | None) -> None:
        self.pid = pid
        self.usedGpuMemory = used


def fake_pynvml(*, device_used: list[int], processes: list[list[FakeProcess]], namespace: str = "GPU",
                init_fails: bool = False) -> types.ModuleType:
    """A FAKE pynvml: ``nvmlDeviceGetMemoryInfo(h).used`` gives ``device_used`` one reading per call (the last one
    repeats), ``nvmlDeviceGetComputeRunningProcesses`` likewise ``processes``; the device answers to
    ``<namespace>-BARE_UUID`` only. It counts nvmlInit and nvmlShutdown calls."""
    fake = types.ModuleType("pynvml")
    fake.calls = {"init": 0, "shutdown": 0, "uuids": []}
    handle = object()

    def init():
        fake.calls["init"] += 1
        if init_fails:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def shutdown():
        fake.calls["shutdown"] += 1

    def by_uuid(uuid):
        fake.calls["uuids"].append(uuid)
        if uuid != f"{namespace}-{BARE_UUID}":
            raise FakeNVMLError("Not Found")
        return handle

    def memory_info(h):
        assert h is handle
        used = device_used.pop(0) if len(device_used) > 1 else device_used[0]
        return types.SimpleNamespace(total=80 * GiB, free=80 * GiB - used, used=used)

    def running(h):
        assert h is handle
        return processes.pop(0) if len(processes) > 1 else processes[0]

    fake.NVMLError = FakeNVMLError
    fake.nvmlInit, fake.nvmlShutdown, fake.nvmlDeviceGetHandleByUUID = init, shutdown, by_uuid
    fake.nvmlDeviceGetMemoryInfo, fake.nvmlDeviceGetComputeRunningProcesses = memory_info, running
    return fake


@pytest.fixture
def fake_cuda(monkeypatch):
    """FAKE torch.cuda functions: device 0's UUID, ``memory_reserved`` and ``mem_get_info`` from lists (one reading
    per call). Returns the lists for the test to fill."""
    state = {"reserved": [0], "mem_get_info": [(80 * GiB, 80 * GiB)], "devices": []}

    def take(name):
        values = state[name]
        return values.pop(0) if len(values) > 1 else values[0]

    def properties(index):
        state["devices"].append(index)
        return types.SimpleNamespace(uuid=BARE_UUID, total_memory=80 * GiB)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: take("reserved"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: take("mem_get_info"))
    return state


def _install(monkeypatch, fake: types.ModuleType | None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake)  # None: ``import pynvml`` raises ImportError


def test_nvml_finds_this_process_by_pid(monkeypatch, fake_cuda):
    # Before CUDA: the device holds 300 MiB (another process, or the driver's bookkeeping). After init NVML lists
    # this process with 2.5 GiB while PyTorch's pool holds 2 GiB: 0.5 GiB is the context, NCCL, cuBLAS.
    fake = fake_pynvml(device_used=[300 * MiB], processes=[[FakeProcess(OTHER_PID, 9 * GiB),
                                                           FakeProcess(os.getpid(), 2 * GiB + 512 * MiB)]])
    _install(monkeypatch, fake)
    fake_cuda["reserved"] = [2 * GiB]
    memory = DeviceMemory.open(cuda=True, index=0)
    assert memory.before_bytes == 300 * MiB and fake.calls["uuids"] == [f"GPU-{BARE_UUID}"]
    memory.sample(init=True)
    assert memory.report() == {"device_memory_source": NVML_PROCESS, "device_used_init_bytes": 2 * GiB + 512 * MiB,
                               "device_non_torch_init_bytes": 512 * MiB, "device_used_peak_bytes": None,
                               "device_non_torch_peak_bytes": None}
    assert fake.calls["init"] == fake.calls["shutdown"] == 1  # NVML counts its users: ours is given back


def test_a_hidden_pid_falls_back_to_the_device_less_its_use_before(monkeypatch, fake_cuda):
    # A container's PID namespace: NVML lists the host pid, never ours. Device used: 300 MiB before CUDA, then
    # 3 GiB + 300 MiB after init, 7 GiB + 300 MiB after a step → this process: 3 GiB, then 7 GiB; PyTorch's pool
    # 2.25 GiB, then 6 GiB → outside it 0.75 GiB, then 1 GiB.
    fake = fake_pynvml(device_used=[300 * MiB, 3 * GiB + 300 * MiB, 7 * GiB + 300 * MiB],
                       processes=[[FakeProcess(OTHER_PID, 3 * GiB)]])
    _install(monkeypatch, fake)
    fake_cuda["reserved"] = [2 * GiB + 256 * MiB, 6 * GiB]
    memory = DeviceMemory.open(cuda=True, index=0)
    memory.sample(init=True)
    memory.sample()
    report = memory.report()
    assert report["device_memory_source"] == NVML_DEVICE
    assert (report["device_used_init_bytes"], report["device_non_torch_init_bytes"]) == (3 * GiB, 768 * MiB)
    assert (report["device_used_peak_bytes"], report["device_non_torch_peak_bytes"]) == (7 * GiB, 1 * GiB)


def test_a_process_without_a_memory_figure_falls_back_too(monkeypatch, fake_cuda):
    # NVML lists this process but gives no usedGpuMemory (NVML_VALUE_NOT_AVAILABLE, which pynvml turns into None).
    fake = fake_pynvml(device_used=[0, 1 * GiB], processes=[[FakeProcess(os.getpid(), None)]])
    _install(monkeypatch, fake)
    memory = DeviceMemory.open(cuda=True, index=0)
    assert memory.used_bytes() == 1 * GiB and memory.source == NVML_DEVICE


def test_without_pynvml_the_whole_device_counts_as_this_ranks(monkeypatch, fake_cuda):
    # cudaMemGetInfo: free 76 GiB of 80 GiB after init, 70 GiB after a step, 72 GiB at the end → 4 GiB, 10 GiB,
    # 8 GiB used; PyTorch's pool 3 GiB, 9 GiB, 9 GiB. The largest training reading (10 GiB) is kept with its pool.
    _install(monkeypatch, None)
    fake_cuda["mem_get_info"] = [(76 * GiB, 80 * GiB), (70 * GiB, 80 * GiB), (72 * GiB, 80 * GiB)]
    fake_cuda["reserved"] = [3 * GiB, 9 * GiB, 9 * GiB]
    memory = DeviceMemory.open(cuda=True, index=0)
    assert memory.nvml is None and memory.before_bytes is None
    memory.sample(init=True)
    memory.sample()
    memory.sample()
    assert memory.report() == {"device_memory_source": CUDA_MEM_GET_INFO, "device_used_init_bytes": 4 * GiB,
                               "device_non_torch_init_bytes": 1 * GiB, "device_used_peak_bytes": 10 * GiB,
                               "device_non_torch_peak_bytes": 1 * GiB}


def test_nvml_without_a_driver_falls_back_to_mem_get_info(monkeypatch, fake_cuda):
    fake = fake_pynvml(device_used=[0], processes=[[]], init_fails=True)
    _install(monkeypatch, fake)
    fake_cuda["mem_get_info"] = [(78 * GiB, 80 * GiB)]
    memory = DeviceMemory.open(cuda=True, index=0)
    assert memory.nvml is None and memory.used_bytes() == 2 * GiB and memory.source == CUDA_MEM_GET_INFO
    assert fake.calls["shutdown"] == 0  # nvmlInit failed: nothing to give back


def test_a_mig_instance_is_found_in_nvmls_mig_namespace(monkeypatch, fake_cuda):
    fake = fake_pynvml(device_used=[0], processes=[[FakeProcess(os.getpid(), 5 * GiB)]], namespace="MIG")
    _install(monkeypatch, fake)
    memory = DeviceMemory.open(cuda=True, index=0)
    assert fake.calls["uuids"] == [f"GPU-{BARE_UUID}", f"MIG-{BARE_UUID}"]
    assert memory.used_bytes() == 5 * GiB and memory.source == NVML_PROCESS


def test_an_unknown_uuid_leaves_nvml_out(monkeypatch, fake_cuda):
    fake = fake_pynvml(device_used=[0], processes=[[FakeProcess(os.getpid(), 5 * GiB)]], namespace="none")
    _install(monkeypatch, fake)
    fake_cuda["mem_get_info"] = [(79 * GiB, 80 * GiB)]
    memory = DeviceMemory.open(cuda=True, index=3)
    assert fake_cuda["devices"] == [3]  # the rank's own device's UUID
    assert memory.handle is None and memory.used_bytes() == 1 * GiB and memory.source == CUDA_MEM_GET_INFO


def test_the_first_reader_that_answers_is_kept(monkeypatch, fake_cuda):
    # Found by pid at init; the next reading lists it no more: that moment has no reading, rather than a figure
    # of another reader that would not compare (device 5 GiB over its use before).
    fake = fake_pynvml(device_used=[0, 5 * GiB], processes=[[FakeProcess(os.getpid(), 2 * GiB)],
                                                            [FakeProcess(OTHER_PID, 2 * GiB)]])
    _install(monkeypatch, fake)
    fake_cuda["reserved"] = [1 * GiB]
    memory = DeviceMemory.open(cuda=True, index=0)
    memory.sample(init=True)
    memory.sample()
    report = memory.report()
    assert report["device_memory_source"] == NVML_PROCESS and report["device_used_init_bytes"] == 2 * GiB
    assert report["device_used_peak_bytes"] is None


def test_a_reader_that_raises_does_not_fail_the_trial(monkeypatch, fake_cuda):
    _install(monkeypatch, None)

    def broken(index=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    memory = DeviceMemory.open(cuda=True, index=0)
    memory.sample(init=True)
    assert memory.report() == EMPTY


def test_cpu_ranks_read_nothing_and_report_none(monkeypatch):
    fake = fake_pynvml(device_used=[0], processes=[[]])
    _install(monkeypatch, fake)
    memory = DeviceMemory.open(cuda=False, index=0)
    memory.sample(init=True)
    memory.sample()
    assert memory.report() == EMPTY and all(value is None for value in EMPTY.values())
    assert fake.calls["init"] == 0  # NVML is never opened for CPU ranks


def test_the_readers_are_tried_in_the_documented_order():
    assert device_memory.READERS == (NVML_PROCESS, NVML_DEVICE, CUDA_MEM_GET_INFO)
