"""One NVMe swap folder per launch (launchers/trial/nvme_folder.py): distinct for two launches, made before each and
removed after it however it ended, while ds_config.json and the exported config keep the study's own nvme_path. The
launch itself is replaced (no ranks start): it records what the ranks were told and what was on disk meanwhile."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from launchers.trial.local import Execution
from launchers.trial.nvme_folder import FOLDER_PREFIX, per_launch_config
from optimizer.study.knobs import OffloadDevice, ZeroStage
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import StudySpec, load_study

ROOT = Path(__file__).resolve().parents[3]


def _nvme_study(folder: Path) -> StudySpec:
    raw = yaml.safe_load((ROOT / "studies" / "cpu-tiny.yaml").read_text())
    (folder / "nvme").mkdir()
    raw["hardware"]["nvme_path"] = str(folder / "nvme")
    raw["search_space"]["knobs"]["offload_param"] = ["none", "nvme"]
    path = folder / "cpu-tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_study(path)


def _nvme_candidate(study: StudySpec):
    return dataclasses.replace(baseline_candidate(study.training), zero_stage=ZeroStage.PARAMETERS,
                               offload_optimizer=OffloadDevice.NVME, offload_param=OffloadDevice.NVME)


def test_each_launch_gets_its_own_folder_under_the_studys_path(tmp_path):
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
                                    "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}
    first, folders = per_launch_config(config, launch_id="aaa", cwd=tmp_path)
    second, other = per_launch_config(config, launch_id="bbb", cwd=tmp_path)
    assert folders == (Path("/nvme/dsopt-aaa"),) and other == (Path("/nvme/dsopt-bbb"),)  # one folder for both
    assert first["zero_optimization"]["offload_param"]["nvme_path"] == "/nvme/dsopt-aaa"
    assert first["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/nvme/dsopt-aaa"
    assert second["zero_optimization"]["offload_param"]["nvme_path"] == "/nvme/dsopt-bbb"
    assert config["zero_optimization"]["offload_param"]["nvme_path"] == "/nvme"  # the caller's config untouched
    relative, (folder,) = per_launch_config({"zero_optimization": {"offload_param": {"nvme_path": "swap"}}},
                                            launch_id="ccc", cwd=tmp_path)
    assert folder == tmp_path / "swap" / f"{FOLDER_PREFIX}ccc"  # where the study file's check found it
    assert relative["zero_optimization"]["offload_param"]["nvme_path"] == str(folder)  # the ranks get it absolute
    plain = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert per_launch_config(plain, launch_id="ddd", cwd=tmp_path) == (plain, ())


def _recording_launch(monkeypatch, *, seen: list, outcome):
    """Replace the launch: record the ranks' nvme_path and whether it existed while they ran; then ``outcome``
    (an Execution, or an exception to raise)."""
    import launchers.trial.run as trial

    def execute(plan, *, timeout_s, log_path):
        rank_plan = json.loads(Path(plan.argv[-2]).read_text())  # launchers.rank.trial_rank PLAN OUT_DIR
        path = Path(rank_plan["config"]["zero_optimization"]["offload_param"]["nvme_path"])
        (path / "zero_stage_3").mkdir()  # what DeepSpeed writes there
        seen.append({"path": path, "existed": path.is_dir()})
        log_path.write_text("torchrun log\n")
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(trial, "execute", execute)


@pytest.mark.parametrize("outcome", [
    Execution(returncode=0, timed_out=False, wall_s=0.5),
    Execution(returncode=1, timed_out=False, wall_s=0.5),  # a crash
    Execution(returncode=None, timed_out=True, wall_s=0.5),  # stopped at its timeout
], ids=["ended", "crashed", "timed-out"])
def test_two_launches_get_distinct_folders_each_removed_afterwards(tmp_path, monkeypatch, outcome):
    from launchers.trial.run import run_trial

    study = _nvme_study(tmp_path)
    seen: list = []
    _recording_launch(monkeypatch, seen=seen, outcome=outcome)
    for slot in ("a", "b"):
        run_trial(study=study, candidate=_nvme_candidate(study), trial_dir=tmp_path / slot)
    assert [s["existed"] for s in seen] == [True, True]
    assert seen[0]["path"] != seen[1]["path"]
    for s in seen:
        assert s["path"].parent == Path(study.hardware.nvme_path) and s["path"].name.startswith(FOLDER_PREFIX)
        assert not s["path"].exists()
    assert list(Path(study.hardware.nvme_path).iterdir()) == []


def test_the_folder_goes_when_the_launch_is_interrupted(tmp_path, monkeypatch):
    from launchers.trial.run import run_trial

    study = _nvme_study(tmp_path)
    seen: list = []
    _recording_launch(monkeypatch, seen=seen, outcome=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        run_trial(study=study, candidate=_nvme_candidate(study), trial_dir=tmp_path / "t")
    assert seen[0]["existed"] and not seen[0]["path"].exists()


def test_the_trial_files_and_the_export_keep_the_users_nvme_path(tmp_path, monkeypatch):
    from launchers.trial.run import run_trial
    from optimizer.results.export import exported_config

    study = _nvme_study(tmp_path)
    seen: list = []
    _recording_launch(monkeypatch, seen=seen, outcome=Execution(returncode=0, timed_out=False, wall_s=0.5))
    candidate = _nvme_candidate(study)
    run_trial(study=study, candidate=candidate, trial_dir=tmp_path / "t")
    user = study.hardware.nvme_path
    written = json.loads((tmp_path / "t" / "ds_config.json").read_text())
    told = json.loads((tmp_path / "t" / "plan.json").read_text())["config"]
    for section in ("offload_optimizer", "offload_param"):
        assert written["zero_optimization"][section]["nvme_path"] == user
        assert told["zero_optimization"][section]["nvme_path"] == str(seen[0]["path"])
    exported = exported_config(spec=study, knobs=candidate.knobs(), hf=False)
    assert exported["zero_optimization"]["offload_param"]["nvme_path"] == user
    assert exported["zero_optimization"]["offload_optimizer"]["nvme_path"] == user


def test_an_nvme_path_that_is_gone_is_a_crash_that_launches_nothing(tmp_path, monkeypatch):
    import launchers.trial.run as trial

    study = _nvme_study(tmp_path)
    Path(study.hardware.nvme_path).rmdir()
    monkeypatch.setattr(trial, "execute", lambda *a, **k: pytest.fail("launched without its swap folder"))
    result = trial.run_trial(study=study, candidate=_nvme_candidate(study), trial_dir=tmp_path / "t")
    assert result.outcome.value == "crash" and "NVMe swap folder could not be made" in result.message
