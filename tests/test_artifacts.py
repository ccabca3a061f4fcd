"""Each launched trial's files in Optuna's artifact store (launchers/artifacts.py), as optuna-dashboard reads them:
a study run through ``run_study`` with a runner that writes what a real launch writes into the trial's folder
(no DeepSpeed: the upload is under test), then the store read back with Optuna's own API."""

from __future__ import annotations

import json
import shutil

import optuna
import pytest
from optuna.artifacts import FileSystemArtifactStore, download_artifact, get_all_artifact_meta

from launchers.artifacts import LOG_TAIL_CHARS, default_store_dir
from launchers.progress import ProgressMode
from launchers.study_run import run_study
from launchers.trial import trial_dir_for
from optimizer.results.trial_result import Outcome, RankMeasurement, TrialResult
from optimizer.study.study_file import load_study


@pytest.fixture
def tiny(repo_root, tmp_path):
    shutil.copy(repo_root / "studies" / "cpu-tiny.yaml", tmp_path / "cpu-tiny.yaml")
    return load_study(tmp_path / "cpu-tiny.yaml")


def _studied(tiny) -> optuna.Study:
    """Four trials of cpu-tiny through run_study, each launch writing what a real one writes in its folder."""
    def runner(candidate, _reference):
        folder = trial_dir_for(tiny, candidate)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "ds_config.json").write_text(json.dumps({"label": candidate.label()}))
        (folder / "result.json").write_text(json.dumps({"outcome": "ok"}))
        (folder / "log.txt").write_text("x" * LOG_TAIL_CHARS + "the last line\n")
        rank = RankMeasurement(rank=0, peak_allocated_bytes=10**6, peak_reserved_bytes=None, peak_rss_bytes=0,
                               step_times_s=(0.1,), training_peak_allocated_bytes=10**6)
        return TrialResult(outcome=Outcome.OK, ranks=(rank,), step_time_s=0.1, tokens_per_s=1000.0,
                           loss_fidelity=0.0, losses=(5.0,))

    return run_study(spec=tiny, storage=f"sqlite:///{tiny.output_dir / 'study.db'}", n_trials=4, timeout_s=None,
                     runner=runner, reference=lambda: [5.0], progress=ProgressMode.QUIET)


def test_every_launched_trial_has_its_config_result_and_log_tail_in_the_store(tiny, tmp_path):
    study = _studied(tiny)
    store = FileSystemArtifactStore(default_store_dir(tiny.output_dir))
    launched = [t for t in study.trials if t.state is optuna.trial.TrialState.COMPLETE
                and "reused_from" not in t.user_attrs]
    assert launched
    for trial in launched:
        metas = {m.filename: m for m in get_all_artifact_meta(trial, storage=study._storage)}
        assert set(metas) == {"ds_config.json", "result.json", "log-tail.txt"}
        path = tmp_path / f"config-{trial.number}.json"
        download_artifact(artifact_store=store, artifact_id=metas["ds_config.json"].artifact_id, file_path=str(path))
        assert json.loads(path.read_text()) == {"label": trial.user_attrs["label"]}
        tail = tmp_path / f"tail-{trial.number}.txt"
        download_artifact(artifact_store=store, artifact_id=metas["log-tail.txt"].artifact_id, file_path=str(tail))
        assert len(tail.read_text()) == LOG_TAIL_CHARS and tail.read_text().endswith("the last line\n")
    for trial in study.trials:
        if trial not in launched:  # pruned, held or reused: launched nothing, uploaded nothing
            assert get_all_artifact_meta(trial, storage=study._storage) == []


def test_dsopt_dashboard_serves_the_study_its_labels_and_a_trials_files(tiny):
    pytest.importorskip("optuna_dashboard")
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    _studied(tiny)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dsopt = Path(sys.executable).parent / "dsopt"
    server = subprocess.Popen([str(dsopt), "dashboard", str(tiny.path), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                studies = json.loads(urllib.request.urlopen(f"{base}/api/studies", timeout=2).read())
                break
            except OSError:
                time.sleep(0.2)
        else:
            pytest.fail("the dashboard did not answer")
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
    finally:
        server.terminate()
        server.wait(timeout=10)
