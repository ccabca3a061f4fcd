"""Where a study's traces run (launchers/trace/study_traces.py ``fill``): each single trace — a deep model's two
shallow copies apart — one item shared between dsopt's process and forked copies of it; what the copies trace is
what this process traces, and a model whose copies do not extend to its parameter count is traced whole."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import pytest

import launchers.trace.forked as forked
from launchers.trace.study_traces import TraceCache, fill
from launchers.trace.trace_depth import shallow_specs
from launchers.trial.run import model_dict
from optimizer.ledger.transformer import trainable_count
from optimizer.study.knobs import Precision
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]


def _jobs(*, layers: int = 2, parameters: bool = False) -> list[dict]:
    model = load_study(ROOT / "studies" / "gpt2-tiny-cpu.yaml").model
    model = dataclasses.replace(model, layers=layers)
    return [{"model_spec": model_dict(model), "parameters": trainable_count(model) if parameters else None,
             "checkpointing": ckpt, "precision": Precision.FP32, "micro_batch": mbs, "sequence_length": 64}
            for ckpt in ("none", "full") for mbs in (1, 2)]


def _recorded(monkeypatch, folder: Path | None = None) -> list[tuple[int, list[int]]]:
    """(items, pids that traced) of each :func:`launchers.trace.forked.shared_map` call. With ``folder``, a copy marks
    there each item it takes, and this process, after its own first item, waits (up to 20 s) until a copy has
    taken one (where there are copies): on a busy machine this process could otherwise trace every item before a copy
    is scheduled."""
    calls: list[tuple[int, list[int]]] = []
    real = forked.shared_map
    here = os.getpid()

    def traced(fn, item, workers):
        if folder is not None and os.getpid() != here:
            (folder / f"copy-{os.getpid()}-{time.monotonic_ns()}").touch()
        value = fn(item)
        if folder is not None and workers > 1 and os.getpid() == here:
            deadline = time.monotonic() + 20
            while not any(folder.glob("copy-*")) and time.monotonic() < deadline:
                time.sleep(0.05)
        return value, os.getpid()

    def recording(fn, items, *, workers):
        out = real(lambda item: traced(fn, item, workers), items, workers=workers)
        calls.append((len(items), [pid for _, pid in out]))
        return [value for value, _ in out]

    monkeypatch.setattr(forked, "shared_map", recording)
    return calls


@pytest.mark.skipif(not forked.fork_safe(), reason="forks only on Linux with one Python thread")
def test_what_the_copies_trace_is_what_this_process_traces(tmp_path, monkeypatch):
    jobs = _jobs(layers=6, parameters=True)[::2]  # deep enough for two shallow copies each; none and full
    assert all(shallow_specs(job["model_spec"], job["checkpointing"], job["parameters"]) for job in jobs)
    (tmp_path / "marks").mkdir()
    calls = _recorded(monkeypatch, tmp_path / "marks")
    here, there = TraceCache(tmp_path / "here"), TraceCache(tmp_path / "there")
    fill(here, jobs, workers=1)
    fill(there, jobs, workers=2)
    assert [items for items, _ in calls] == [4, 4]  # each job's two copies, one item each
    assert set(calls[0][1]) == {os.getpid()}
    threads = [thread.name for thread in threading.enumerate()]
    assert os.getpid() in calls[1][1] and len(set(calls[1][1])) == 2, threads  # shared with a copy
    for job in jobs:
        assert here.holds(**job)
        assert here.entry(**job) == there.entry(**job)
    alone = TraceCache(tmp_path / "alone")  # one by one, as a cache miss traces
    assert all(alone.entry(**job) == here.entry(**job) for job in jobs)


def test_a_model_whose_copies_do_not_extend_is_traced_whole(tmp_path, monkeypatch):
    jobs = _jobs(layers=6, parameters=True)[:1]
    jobs[0]["parameters"] += 1  # a count the copies cannot extend to: a structure they miss
    calls = _recorded(monkeypatch)
    cache = TraceCache(tmp_path / "traces")
    fill(cache, jobs, workers=2)
    assert [items for items, _ in calls] == [2, 1]  # the two copies, then the model whole
    assert "extended linearly" not in " ".join(cache.entry(**jobs[0])["result"]["notes"])


def test_shallow_models_are_traced_whole_in_one_round(tmp_path, monkeypatch):
    calls = _recorded(monkeypatch)
    cache = TraceCache(tmp_path / "traces")
    fill(cache, _jobs(), workers=2)
    assert [items for items, _ in calls] == [4]
    assert all(cache.holds(**job) for job in _jobs())
