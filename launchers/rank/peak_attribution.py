"""What is live at a CPU rank's measured peak, tensor by tensor: the trial's rank program with the profiler
recording call stacks, and at the training peak every allocation still live grouped by where it was made.

Run as the rank program (``python -m launchers.rank.peak_attribution PLAN OUT``) by
``benchmarks/peak_attribution.py``: it is :mod:`launchers.rank.trial_rank` with the profiler started with
``with_stack=True`` and, when the profiled span ends, ``OUT/attribution.rankN.json`` written beside the
rank's usual report. The peak is c10's all-thread counter (:mod:`launchers.measure.cpu_memory`), exact; the live set
at that moment pairs the main thread's allocations and frees by address, so a tensor freed on gloo's
thread still reads live — the listing's sum (``paired_live_bytes``) can exceed the peak, and the difference
is what other threads had freed by then.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from torch._C._profiler import _EventType

import launchers.measure.cpu_memory as cpu_memory
import launchers.rank.trial_rank as trial_rank
from launchers.process.cpu_info import install as keep_cpu_info

FRAMES = int(os.environ.get("DSOPT_ATTRIBUTION_FRAMES", "6"))
"""Frames of the allocation's stack kept per group (innermost first); benchmarks/peak_attribution.py --frames."""
KEPT_FRAMES = ("deepspeed/", "launchers/", "torch/nn/", "torch/autograd/", "torch/utils/checkpoint", "transformers/")
"""Python frames worth naming; the rest (the interpreter's own, the profiler's) are skipped."""


def _name(node: Any) -> str:
    try:
        return str(node.name)
    except UnicodeDecodeError:  # a frame name the profiler recorded badly
        return "?"


def where(node: Any) -> str:
    """The allocation's site: its enclosing ops and the named Python frames, innermost first."""
    chain: list[str] = []
    parent = node.parent
    while parent is not None and len(chain) < FRAMES:
        name = _name(parent)
        if parent.tag == _EventType.TorchOp:
            chain.append(f"op:{name}")
        elif parent.tag in (_EventType.PyCall, _EventType.PyCCall) and any(k in name for k in KEPT_FRAMES):
            chain.append(name.split("site-packages/")[-1])
        parent = parent.parent
    return " <- ".join(chain)


def live_at_peak(profiler: cpu_memory.CpuProfiler, *, after_range: str) -> dict[str, Any]:
    """The training peak (after ``after_range``'s end) and the allocations live then, grouped by site."""
    nodes = list(cpu_memory._walk(profiler.profiler.kineto_results.experimental_event_tree()))
    ends = [n.end_time_ns for n in nodes if n.tag == _EventType.TorchOp and _name(n) == after_range]
    start = max(ends, default=0)
    events = sorted((n for n in nodes if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu"),
                    key=lambda n: n.start_time_ns)
    if not events:
        return {"peak_bytes": 0, "paired_live_bytes": 0, "at": "", "groups": []}
    first = events[0].extra_fields
    baseline = first.total_allocated - first.alloc_size
    peak, peak_index = -1, 0
    for index, node in enumerate(events):
        total = node.extra_fields.total_allocated - baseline
        if node.start_time_ns > start and total > peak:
            peak, peak_index = total, index
    live: dict[int, tuple[int, Any]] = {}
    for node in events[:peak_index + 1]:
        fields = node.extra_fields
        live.pop(fields.ptr, None)
        if fields.alloc_size > 0:
            live[fields.ptr] = (fields.alloc_size, node)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, node in live.values():
        group = groups[where(node)]
        group[0] += size
        group[1] += 1
    return {"peak_bytes": peak, "paired_live_bytes": sum(size for size, _ in live.values()),
            "at": where(events[peak_index]),
            "groups": sorted(([size, count, site] for site, (size, count) in groups.items()), reverse=True)}


def main() -> int:
    keep_cpu_info()  # py-cpuinfo asked once per node (launchers/process/cpu_info.py)
    out_dir = Path(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))

    def start() -> cpu_memory.CpuProfiler:
        return cpu_memory.start_cpu_profiler(with_stack=True)

    def stop(profiler: cpu_memory.CpuProfiler, *, ranges: tuple[str, ...] = ()) -> cpu_memory.LivePeaks:
        profiler.stop()
        counted = cpu_memory.count_every_thread(False)
        report = live_at_peak(profiler, after_range=trial_rank.INIT_MARK) if counted else {"error": "no counter"}
        (out_dir / f"attribution.rank{rank}.json").write_text(json.dumps(report, indent=1) + "\n")
        return cpu_memory.live_tensor_peaks(profiler, ranges=ranges, every_thread=counted)

    trial_rank.start_cpu_profiler = start
    trial_rank.stop_cpu_profiler = stop
    return trial_rank.main()


if __name__ == "__main__":
    from launchers.process.collector import end_rank

    end_rank(main())
