"""The recorded grid and the replayed strategies of benchmarks/search_efficiency.py (fast parts only)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GRID = ROOT / "benchmarks" / "data" / "grid-cpu.json"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("search_efficiency", ROOT / "benchmarks" / "search_efficiency.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_grid_is_complete_and_describes_its_machine():
    data = json.loads(GRID.read_text())
    assert len(data["candidates"]) == 84 and {"cpu", "cores", "versions"} <= set(data["machine"])
    assert data["command"].startswith("python benchmarks/record_grid.py")
    assert all(e["outcome"] in ("ok", "oom", "crash", "nan", "timeout", "unsupported") for e in data["candidates"])


def test_autotuner_walk_tunes_only_stage_and_micro_batch(bench):
    grid = bench.load_grid(GRID)
    run = bench.run_autotuner(grid)
    knobs = [grid.entries[label]["knobs"] for label in run.launched]
    assert {k["precision"] for k in knobs} == {"fp32"} and {k["checkpointing"] for k in knobs} == {"none"}
    assert {k["offload_optimizer"] for k in knobs} == {"none"}
    stages = [k["zero_stage"] for k in knobs]
    assert stages == sorted(stages)  # stages walked in order 0 -> 3


def test_random_order_eventually_reaches_the_best(bench):
    grid = bench.load_grid(GRID)
    run = bench.run_random(grid, seed=0)
    assert run.reached_at == len(run.launched) and grid.hit(grid.entries[run.launched[-1]])
