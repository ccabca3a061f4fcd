"""Two ``dsopt worker`` processes on one Optuna journal file (JournalFileBackend), real DeepSpeed trials."""

from __future__ import annotations

import json

import optuna
import pytest
from cluster_helpers import launches, start_worker, write_cluster_study

from optimizer.search.storage import open_storage
from optimizer.study.study_file import load_study

pytestmark = pytest.mark.slow


def test_two_workers_complete_a_study_on_a_journal_file(tmp_path):
    path = write_cluster_study(tmp_path, budget={"max_launches": 3})  # the FP32 reference + 2 trials
    storage = f"journal://{tmp_path / 'study.log'}"
    procs = [start_worker(path, storage, tmp_path / f"worker{i}.log") for i in range(2)]
    for proc in procs:
        proc.wait(timeout=600)
    logs = [(tmp_path / f"worker{i}.log").read_text() for i in range(2)]
    assert [p.returncode for p in procs] == [0, 0], logs

    records = launches(tmp_path / path.stem)
    assert sum(1 for r in records if r["event"] == "start" and r["trial_dir"].endswith("/reference")) == 1
    started = [r for r in records if r["event"] == "start" and not r["trial_dir"].endswith("/reference")]
    assert len(started) == 2 and len({json.dumps(r["candidate"], sort_keys=True) for r in started}) == 2

    spec = load_study(path)
    stored = optuna.load_study(study_name=spec.name, storage=open_storage(storage, workers=spec.workers))
    measured = [t for t in stored.get_trials() if t.state is optuna.trial.TrialState.COMPLETE
                and "reused_from" not in t.user_attrs]
    by_reference = [t for t in measured if t.user_attrs.get("measured_by") == "the FP32 reference run"]
    assert len(by_reference) == 1 and by_reference[0].user_attrs["launches"] == 0  # the reference's own launch
    assert len(measured) == 3 and stored.best_trials
    assert not [t for t in stored.get_trials() if t.state is optuna.trial.TrialState.RUNNING]
