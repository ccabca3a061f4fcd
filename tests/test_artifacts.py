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
from optimizer.study_file import load_study
from optimizer.trial_result import Outcome, RankMeasurement, TrialResult


@pytest.fixture
def tiny(repo_root, tmp_path):
    shutil.copy(repo_root / "studies" / "cpu-tiny.yaml", tmp_path / "cpu-tiny.yaml")
    return load_study(tmp_path / "cpu-tiny.yaml")


def test_every_launched_trial_has_its_config_result_and_log_tail_in_the_store(tiny, tmp_path):
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

    storage = f"sqlite:///{tiny.output_dir / 'study.db'}"
    study = run_study(spec=tiny, storage=storage, n_trials=4, timeout_s=None, runner=runner,
                      reference=lambda: [5.0], progress=ProgressMode.QUIET)
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
