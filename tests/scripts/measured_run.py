"""Run a training script as it is — no dsopt hook, no patch of DeepSpeed — under the CPU profiler with c10's
all-thread counter, and write this rank's live-tensor peak over the whole run to ``OUT/peak<rank>.json``.

    torchrun --nproc_per_node 2 tests/scripts/measured_run.py OUT train.py ARGS...

Tests use it to check that an exported config, given back to the script in a plain run, peaks as its trial did."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

from launchers.measure.cpu_memory import start_cpu_profiler, stop_cpu_profiler

out, script, *args = sys.argv[1:]
profiler = start_cpu_profiler()
sys.argv = [script, *args]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    peaks = stop_cpu_profiler(profiler)
    rank = os.environ.get("RANK", "0")
    Path(out, f"peak{rank}.json").write_text(json.dumps({"peak": peaks.peak, "every_thread": peaks.every_thread}))
