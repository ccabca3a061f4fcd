"""Each launched trial's files in Optuna's artifact store (launchers/study/artifacts.py), as optuna-dashboard reads
them: a study run through ``run_study`` with a runner that writes what a real launch writes into the trial's folder
(tests/dashboard_study.py; no DeepSpeed: the upload is under test), then the store read back with Optuna's own
API and through a real ``dsopt dashboard`` server."""

from __future__ import annotations

import json
import urllib.request

import optuna
import pytest
from dashboard_study import dashboard, studied
from optuna.artifacts import FileSystemArtifactStore, download_artifact, get_all_artifact_meta

from launchers.study.artifacts import LOG_TAIL_CHARS, default_store_dir


@pytest.mark.slow  # seconds each: a real model trace / a whole study
def test_every_launched_trial_has_its_config_result_and_log_tail_in_the_store(tiny, tmp_path):
    study = studied(tiny)
    storage = optuna.storages.get_storage(f"sqlite:///{tiny.output_dir / 'study.db'}")
    store = FileSystemArtifactStore(default_store_dir(tiny.output_dir))
    launched = [t for t in study.trials if t.state is optuna.trial.TrialState.COMPLETE
                and "reused_from" not in t.user_attrs]
    assert launched
    for trial in launched:
        metas = {m.filename: m for m in get_all_artifact_meta(trial, storage=storage)}
        assert set(metas) == {"ds_config.json", "result.json", "log-tail.txt"}
        path = tmp_path / f"config-{trial.number}.json"
        download_artifact(artifact_store=store, artifact_id=metas["ds_config.json"].artifact_id, file_path=str(path))
        assert json.loads(path.read_text()) == {"label": trial.user_attrs["label"]}
        tail = tmp_path / f"tail-{trial.number}.txt"
        download_artifact(artifact_store=store, artifact_id=metas["log-tail.txt"].artifact_id, file_path=str(tail))
        assert len(tail.read_text()) == LOG_TAIL_CHARS and tail.read_text().endswith("the last line\n")
    for trial in study.trials:
        if trial not in launched:  # pruned, held or reused: launched nothing, uploaded nothing
            assert get_all_artifact_meta(trial, storage=storage) == []


def test_dsopt_dashboard_serves_the_study_its_labels_and_a_trials_files(tiny):
    pytest.importorskip("optuna_dashboard")
    studied(tiny)
    with dashboard(tiny.path) as base:
        studies = json.loads(urllib.request.urlopen(f"{base}/api/studies", timeout=5).read())
        (summary,) = studies["study_summaries"]
        assert summary["study_name"] == tiny.name
        detail = json.loads(urllib.request.urlopen(f"{base}/api/studies/{summary['study_id']}?after=0",
                                                   timeout=5).read())
        assert detail["best_trials"]  # the Pareto front the dashboard draws
        trial = next(t for t in detail["trials"] if t["artifacts"])
        labels = {a["key"]: a["value"] for a in trial["user_attrs"]}
        config = next(a for a in trial["artifacts"] if a["filename"] == "ds_config.json")
        served = urllib.request.urlopen(f"{base}/artifacts/{summary['study_id']}/{trial['trial_id']}/"
                                        f"{config['artifact_id']}", timeout=5).read()
        assert json.loads(served) == {"label": labels["label"]}
