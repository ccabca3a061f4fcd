"""Several ``dsopt worker`` processes on one study in a real PostgreSQL, with real DeepSpeed trials on CPU ranks.

Checks the promises of many workers on one study from what actually happened: the launch log every launch appends to
(``launches.jsonl``, written by the trial launcher, not by the coordination code) and the Optuna storage.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import time
from pathlib import Path

import optuna
import pytest
from cluster_helpers import launches, start_worker, wait_for, write_cluster_study

from launchers.trial.local import marked_processes
from optimizer.search.coordination import active_claims
from optimizer.search.storage import open_storage
from optimizer.study.study_file import load_study

pytestmark = pytest.mark.slow
FAST_HEARTBEAT = {"heartbeat_s": 1, "grace_s": 4, "max_retry": 2}


def _stored(path: Path, url: str) -> optuna.Study:
    spec = load_study(path)
    return optuna.load_study(study_name=spec.name, storage=open_storage(url, workers=spec.workers))


def _trial_launches(study_dir: Path, event: str = "start") -> list[dict]:
    return [r for r in launches(study_dir) if r["event"] == event and not r["trial_dir"].endswith("/reference")]


def _key(knobs: dict) -> str:
    return json.dumps(knobs, sort_keys=True)


def test_three_workers_share_one_study(tmp_path, postgres_url):
    path = write_cluster_study(tmp_path, budget={"max_launches": 6}, workers=FAST_HEARTBEAT)  # 5 + the reference
    study_dir = tmp_path / path.stem
    procs = [start_worker(path, postgres_url, tmp_path / f"worker{i}.log") for i in range(3)]
    for proc in procs:
        proc.wait(timeout=600)
    logs = {i: (tmp_path / f"worker{i}.log").read_text() for i in range(3)}
    assert [p.returncode for p in procs] == [0, 0, 0], logs
    assert all("postgresql+psycopg://dsopt:***@" in text and ":dsopt@" not in text for text in logs.values())

    # The FP32 reference ran once, seeding enqueued its 3 candidates once.
    reference_runs = [r for r in launches(study_dir) if r["event"] == "start" and r["trial_dir"].endswith("/reference")]
    assert len(reference_runs) == 1
    stored = _stored(path, postgres_url)
    seeds = [t for t in stored.get_trials() if t.user_attrs.get("enqueued_by") == "seed"]
    assert len(seeds) == 3 and all("fixed_params" in t.system_attrs for t in seeds)

    # The global cap: exactly max_launches launches, all workers together — the FP32 reference's one and five
    # trials — each candidate at most once.
    started = _trial_launches(study_dir)
    assert len(started) == 5
    assert len({_key(r["candidate"]) for r in started}) == 5
    assert len(_trial_launches(study_dir, "end")) == 5
    assert len({r["worker"] for r in started}) >= 2, "the work was not shared"

    # Every launch is recorded once in the study, by the worker that made it; nothing is left running.
    claimed = [t for t in active_claims(stored.get_trials()) if "measured_by" not in t.user_attrs]
    by_reference = [t for t in stored.get_trials() if t.user_attrs.get("measured_by") == "the FP32 reference run"]
    assert len(by_reference) == 1 and by_reference[0].user_attrs["launches"] == 0  # recorded, not launched again
    assert sorted(_key(t.user_attrs["candidate"]) for t in claimed) == sorted(_key(r["candidate"]) for r in started)
    assert collections.Counter(t.user_attrs["worker"] for t in claimed) == collections.Counter(
        r["worker"] for r in started)
    assert all(t.state is optuna.trial.TrialState.COMPLETE for t in claimed)
    assert not [t for t in stored.get_trials() if t.state is optuna.trial.TrialState.RUNNING]
    assert any("budget is spent" in text for text in logs.values())


def test_a_killed_worker_s_trial_is_failed_and_retried_elsewhere(tmp_path, postgres_url):
    path = write_cluster_study(tmp_path, budget={"max_launches": 5}, workers=FAST_HEARTBEAT)  # 4 + the reference
    study_dir = tmp_path / path.stem
    procs = [start_worker(path, postgres_url, tmp_path / f"worker{i}.log") for i in range(2)]
    first = wait_for(lambda: _trial_launches(study_dir), timeout_s=300, what="a first trial launch")[0]
    victim_pid = int(first["worker"].split(":")[1].split("/")[0])
    victim = next(p for p in procs if p.pid == victim_pid)
    time.sleep(1.0)  # let the ranks start
    os.kill(victim_pid, signal.SIGKILL)
    victim.wait(timeout=30)
    survivor = next(p for p in procs if p is not victim)
    # The killed worker's launcher and ranks die with it (parent-death signal), not trained on as orphans.
    wait_for(lambda: not marked_processes(first["launch_id"]), timeout_s=30, what="the orphaned ranks to exit")
    survivor.wait(timeout=600)
    log = (tmp_path / f"worker{procs.index(survivor)}.log").read_text()
    assert survivor.returncode == 0, log

    stored = _stored(path, postgres_url)
    trials = stored.get_trials()
    killed = [t for t in trials if t.user_attrs.get("worker") == first["worker"]
              and t.user_attrs.get("candidate") == first["candidate"]]
    assert len(killed) == 1 and killed[0].state is optuna.trial.TrialState.FAIL
    assert "outcome" not in killed[0].user_attrs  # failed as stale by the heartbeat, not by a classified outcome
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == killed[0].number]
    assert retried, "the stale trial was not put back in the queue"
    done = [t for t in retried if t.state is optuna.trial.TrialState.COMPLETE]
    assert len(done) == 1 and done[0].user_attrs["candidate"] == first["candidate"]
    assert done[0].user_attrs["worker"] != first["worker"]
    # No completed trial lost: every launch that ended ok is a COMPLETE trial with values.
    ok_ends = [r for r in _trial_launches(study_dir, "end") if r["outcome"] == "ok"]
    measured = [t for t in trials if t.state is optuna.trial.TrialState.COMPLETE and "reused_from" not in t.user_attrs
                and "measured_by" not in t.user_attrs]  # the FP32 reference's trial: its launch is the reference's
    assert len(ok_ends) == len(measured) and all(t.values for t in measured)
    # The cap is met exactly: max_launches 5 = the FP32 reference's one launch + 4 trial launches — the killed one
    # (its claim stays on the stale FAIL trial and counts, coordination.launches_used), its retry and two more. The
    # space has 18 candidates (studies/cluster-cpu.yaml), so the cap, not the space, ends the study.
    assert len(_trial_launches(study_dir)) == 4
