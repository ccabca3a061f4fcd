"""The true peak of live tensor bytes on CPU ranks, from the PyTorch profiler's allocation events.

DeepSpeed's ``max_memory_allocated`` on its CPU accelerator is the RSS sampled when called, not a peak,
and ``MemTracker`` refuses DeepSpeed's ZeRO optimizers. The profiler with ``profile_memory=True`` records
the CPU allocator's allocations and frees (``c10::ProfiledCPUMemoryReporter`` in c10/core/CPUAllocator.cpp
calls ``reportMemoryUsageToProfiler``) — but only on the thread that started it. A tensor whose last
reference dies on gloo's worker thread (a bucket handed to ``all_reduce``, a ZeRO-3 gather, zero.Init's
broadcast) is freed there, unseen, so pairing the events by address leaves it "live" until its address is
reused: measured here, ZeRO-3 peaks read up to 17 % high and a ZeRO-0 trial now and then carried one
gradient bucket too many. ``profile_all_threads=True`` is no cure: it drops the allocation events altogether.

The counter behind each event is: ``ProfiledCPUMemoryReporter`` keeps one mutex-guarded ``allocated_`` for
the process and updates it on every thread when ``profile_memory`` is on for that thread *or* the c10 flag
``caffe2_report_cpu_memory_usage`` is set; every event carries it as ``total_allocated``. With the flag set
(:func:`start_cpu_profiler` sets it through its exported symbol, :func:`stop_cpu_profiler` clears it), the
events of the main thread read the live bytes of every thread, frees on gloo's threads included, and the peak
over them is the live-tensor peak of the process (an allocation made on another thread is counted from the
next main-thread event on). Without the flag (a libc10 that does not export it) the events are paired by
address, as before, and the figure is an upper bound.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._C._profiler import _EventType

COUNT_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"
"""The c10 flag (c10/core/CPUAllocator.cpp: ``C10_DEFINE_bool(caffe2_report_cpu_memory_usage, ...)``) that
makes the CPU allocator count every thread's allocations and frees."""


def _count_flag() -> ctypes.c_bool | None:
    """The flag inside the libc10 this torch loaded, or None where the library does not export it."""
    library_dir = Path(torch.__file__).parent / "lib"
    for path in sorted(library_dir.glob("libc10.*")):
        if path.suffix not in {".so", ".dylib"} and ".so." not in path.name:
            continue
        try:
            return ctypes.c_bool.in_dll(ctypes.CDLL(os.fspath(path)), COUNT_FLAG)
        except (OSError, ValueError):
            continue
    return None


def count_every_thread(on: bool) -> bool:
    """Set or clear c10's all-thread allocation counter; True when the flag exists (and now reads ``on``)."""
    flag = _count_flag()
    if flag is None:
        return False
    flag.value = on
    return True


def _walk(nodes: Any) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _walk(node.children)


class CpuProfiler:
    """What ``torch.profiler.profile(activities=[CPU], profile_memory=True)`` runs, without its one import.

    ``torch.profiler.profile.start`` is ``prepare_trace`` + ``start_trace``: the autograd profiler
    (``torch.autograd.profiler.profile``, ``use_kineto=True``, CPU only) prepared and started, and ``stop`` is its
    ``__exit__`` (torch 2.13 ``profiler/profiler.py:294-345, 388-399``) — this class does the same. But
    ``prepare_trace`` first asks ``hasattr(torch, "_inductor")`` for a CUDA-graphs flag (``:295``), and torch's lazy
    module attribute (``torch/__init__.py`` ``__getattr__``) imports ``torch._inductor`` to answer: 1.9 s per rank on a
    2-core machine, in every trial and script trial on CPU ranks, for a flag a CPU memory profile never reads.
    ``profiler`` is the autograd profiler, as on ``torch.profiler.profile``; its ``kineto_results`` hold the events."""

    def __init__(self, *, with_stack: bool = False) -> None:
        self.profiler = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True, with_stack=with_stack,
                                                        use_kineto=True)

    def start(self) -> None:
        self.profiler.__enter__()

    def stop(self) -> None:
        self.profiler.__exit__(None, None, None)


def start_cpu_profiler(*, with_stack: bool = False) -> CpuProfiler:
    """A started profiler recording CPU allocations, every thread counted (start it before the model is built);
    ``with_stack``: each event with its Python stack (``launchers/rank/peak_attribution.py``)."""
    count_every_thread(True)
    profiler = CpuProfiler(with_stack=with_stack)
    profiler.start()
    return profiler


@dataclass(frozen=True, kw_only=True, slots=True)
class LivePeaks:
    """Live CPU tensor bytes over a profiled span, counted from its start."""

    peak: int
    """The peak over the whole span."""
    until: dict[str, int]
    """Per ``record_function`` range asked for: the peak up to the end of that range (the whole span's peak
    when the range was not recorded)."""
    after: dict[str, int]
    """Per ``record_function`` range asked for: the peak after the end of that range (0 when nothing was
    allocated after it; the whole span's peak when the range was not recorded)."""
    final: int
    """Live at the last recorded event."""
    every_thread: bool
    """True when the figures are c10's all-thread counter; False when they pair the main thread's events by
    address (frees on other threads unseen: an upper bound)."""


def _paired_totals(events: list[Any]) -> list[int]:
    """Live bytes after each event, pairing allocations and frees by address: a free removes its block; an
    allocation at an address still counted live replaces the stale block."""
    live: dict[int, int] = {}
    current = 0
    totals = []
    for node in events:
        fields = node.extra_fields
        current -= live.pop(fields.ptr, 0)
        if fields.alloc_size > 0:
            live[fields.ptr] = fields.alloc_size
            current += fields.alloc_size
        totals.append(current)
    return totals


def live_tensor_peaks(profiler: CpuProfiler, *, ranges: tuple[str, ...] = (),
                      every_thread: bool = True) -> LivePeaks:
    """Live CPU tensor bytes over the profiled span in one pass; ``ranges`` names ``record_function`` ranges
    whose ends split the span (e.g. model construction, the init phase). ``every_thread``: the counter flag
    was set while profiling (:func:`start_cpu_profiler`), so the events' ``total_allocated`` is used."""
    nodes = list(_walk(profiler.profiler.kineto_results.experimental_event_tree()))
    marks = [node for node in nodes if node.tag == _EventType.TorchOp]  # record_function ranges are ops
    ends = {name: max((node.end_time_ns for node in marks if node.name == name), default=None) for name in ranges}
    events = sorted((node for node in nodes if node.tag == _EventType.Allocation
                     and node.extra_fields.device.type == "cpu"), key=lambda node: node.start_time_ns)
    if every_thread and events:
        first = events[0].extra_fields
        baseline = first.total_allocated - first.alloc_size  # the counter just before the span's first event
        totals = [node.extra_fields.total_allocated - baseline for node in events]
    else:
        totals = _paired_totals(events)
    until = dict.fromkeys(ranges, 0)
    after = dict.fromkeys(ranges, 0)
    for node, total in zip(events, totals, strict=True):
        for name, end_ns in ends.items():
            if end_ns is None or node.start_time_ns <= end_ns:
                until[name] = max(until[name], total)
            if end_ns is None or node.start_time_ns > end_ns:
                after[name] = max(after[name], total)
    return LivePeaks(peak=max(totals, default=0), until=until, after=after, final=totals[-1] if totals else 0,
                     every_thread=every_thread and bool(events))


def stop_cpu_profiler(profiler: CpuProfiler, *, ranges: tuple[str, ...] = ()) -> LivePeaks:
    """Stop a profiler from :func:`start_cpu_profiler`, read its peaks, and clear the counter flag."""
    profiler.stop()
    counted = count_every_thread(False)
    return live_tensor_peaks(profiler, ranges=ranges, every_thread=counted)


def live_tensor_peak(profiler: CpuProfiler) -> tuple[int, int]:
    """(peak, final) live CPU tensor bytes over a stopped profiler's span (:func:`live_tensor_peaks`)."""
    peaks = live_tensor_peaks(profiler, every_thread=_count_flag() is not None)
    return peaks.peak, peaks.final
