"""Where a study's traces run (launchers/trace/study_traces.py ``fill``): the first in dsopt's own process, timed,
and the rest there too unless two or more worker processes would finish them sooner than one worker takes to start;
what the workers trace is what this process traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from launchers.trace.study_traces import TraceCache, fill, worth_workers
from launchers.trial.run import model_dict
from optimizer.study.knobs import Precision
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("first_s", "left", "workers", "worth"), [
    (1.5, 7, 2, False),  # an example's eight short traces: 5.25 s saved at most, less than a worker's start
    (0.9, 23, 2, True),  # cpu-tiny's 24: 10.35 s saved
    (3.0, 59, 2, True),  # a 70B plan's 60
    (3.0, 59, 1, False),  # one CPU: nothing runs side by side
    (100.0, 1, 2, False),  # one trace left: one process either way
])
def test_workers_start_only_where_they_save_more_than_their_start(first_s, left, workers, worth):
    assert worth_workers(first_s=first_s, left=left, workers=workers, start_s=8.0) is worth


def _jobs() -> list[dict]:
    model = load_study(ROOT / "studies" / "gpt2-tiny-cpu.yaml").model
    return [{"model_spec": model_dict(model), "parameters": None, "checkpointing": ckpt, "precision": Precision.FP32,
             "micro_batch": mbs, "sequence_length": 64} for ckpt in ("none", "full") for mbs in (1, 2)]


def test_few_short_traces_stay_in_this_process(tmp_path, monkeypatch):
    def no_pool(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr("concurrent.futures.ProcessPoolExecutor", no_pool)
    cache = TraceCache(tmp_path / "traces")
    fill(cache, _jobs(), workers=2)
    assert all(cache.holds(**job) for job in _jobs())


@pytest.mark.slow  # two spawned workers import torch
def test_what_the_workers_trace_is_what_this_process_traces(tmp_path, monkeypatch):
    from concurrent import futures

    started: list[int] = []

    pool = futures.ProcessPoolExecutor

    def counted(*args, **kwargs):
        started.append(kwargs["max_workers"])
        return pool(*args, **kwargs)

    monkeypatch.setattr(futures, "ProcessPoolExecutor", counted)
    here, there = TraceCache(tmp_path / "here"), TraceCache(tmp_path / "there")
    fill(here, _jobs(), workers=2, start_s=float("inf"))
    fill(there, _jobs(), workers=2, start_s=0.0)
    assert started == [2]  # the three traces after the first, in two workers
    for job in _jobs():
        assert here.entry(**job) == there.entry(**job)
