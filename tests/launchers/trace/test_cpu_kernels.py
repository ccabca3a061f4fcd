"""The CPU's promoted input copies in a trace (launchers/trace/cpu_kernels.py): a mixed-dtype pointwise op on the
real CPU allocates a copy of the lower-precision input beside its output; the trace of a CPU-rank study makes the
same copy, and only there."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

import launchers.measure.cpu_memory as cpu_memory
from launchers.trace.cpu_kernels import cpu_promotion_copies

SHAPE = (2, 40, 344)


def _real_peak(a: torch.Tensor, b: torch.Tensor) -> int:
    """Live bytes at the peak of ``a + b`` on the real CPU (c10's counter), over the inputs."""
    profiler = cpu_memory.start_cpu_profiler()
    out = a + b
    peaks = cpu_memory.stop_cpu_profiler(profiler)
    del out
    return peaks.peak


def _traced_peak(dtypes: tuple[torch.dtype, torch.dtype], *, cpu: bool) -> int:
    with FakeTensorMode():
        a, b = (torch.randn(SHAPE, dtype=d) for d in dtypes)
        tracker = MemTracker()
        with tracker, cpu_promotion_copies(cpu):
            out = a + b
        del out
    return sum(v for d in tracker.get_tracker_snapshot("peak").values() for k, v in d.items()
               if getattr(k, "value", str(k)) in ("Activation", "Temp"))


def test_a_mixed_dtype_add_on_the_cpu_copies_its_bf16_input_and_the_cpu_trace_does_too():
    elements = 2 * 40 * 344
    bf16, fp32 = torch.randn(SHAPE, dtype=torch.bfloat16), torch.randn(SHAPE)
    assert _real_peak(bf16, fp32) == 4 * elements + 4 * elements  # the fp32 output and the fp32 copy of bf16
    assert _real_peak(fp32, fp32) == 4 * elements  # one dtype: the output alone
    assert _traced_peak((torch.bfloat16, torch.float32), cpu=True) >= 2 * 4 * elements
    assert _traced_peak((torch.bfloat16, torch.float32), cpu=False) < 2 * 4 * elements  # a GPU casts in the kernel
    assert _traced_peak((torch.float32, torch.float32), cpu=True) < 2 * 4 * elements
