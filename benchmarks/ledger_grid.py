"""Benchmark: the ledger over a whole search space (pure Python), candidates per second.

    python benchmarks/ledger_grid.py [STUDY.yaml] [--repeat N]

Default study: studies/llama-7b-8xh100.yaml (Llama-2-7B shape, 8 x H100 80 GB) with the default search
space (every knob: 2,160 candidates, valid or not). Prints the machine, the grid size, the best and
median wall time of evaluating the whole grid, and candidates per second. Target: well under 100 ms
for the whole grid. A benchmark, not a test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

from optimizer.ledger.core import evaluate
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", nargs="?", default=str(ROOT / "studies" / "llama-7b-8xh100.yaml"))
    parser.add_argument("--repeat", type=int, default=20, help="timed passes over the grid")
    args = parser.parse_args()

    study = load_study(args.study)
    candidates = list(study.search_space.candidates(baseline_candidate(study.training)))
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}

    def grid() -> list:
        return [evaluate(candidate=c, **spec) for c in candidates]

    start = time.perf_counter()
    verdicts = grid()  # first pass: also fills the per-model caches (parameter layout)
    cold = time.perf_counter() - start
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        grid()
        times.append(time.perf_counter() - start)
    best, median = min(times), statistics.median(times)
    valid = sum(v.ledger is not None for v in verdicts)
    fits = sum(v.fits for v in verdicts)
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"{platform.system()}")
    print(f"study: {study.name} ({study.path}), space: {study.search_space.source}")
    print(f"grid: {len(candidates)} candidates ({valid} valid, {fits} fit, {len(candidates) - valid} invalid)")
    print(f"whole grid: first pass {cold * 1e3:.1f} ms; then best {best * 1e3:.1f} ms, median {median * 1e3:.1f} ms "
          f"over {args.repeat} passes")
    print(f"throughput: {len(candidates) / median:,.0f} candidates/s (median)")
    print(f"target: whole grid < 100 ms -> {'met' if median < 0.1 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
