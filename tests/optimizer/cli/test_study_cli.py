"""Bad input for the study commands: one clear line, exit 2, nothing written (no DeepSpeed launch)."""

from __future__ import annotations

from pathlib import Path

import optuna
import yaml

from optimizer.cli import main

ROOT = Path(__file__).resolve().parents[3]


def _study(folder: Path, **knobs) -> Path:
    raw = yaml.safe_load((ROOT / "studies" / "demo-cpu.yaml").read_text())
    raw["name"] = "bad"
    if knobs:
        raw["search_space"] = {"knobs": knobs}
    path = folder / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_empty_space_after_validation(tmp_path, capsys):
    path = _study(tmp_path, micro_batch_size=[3])  # 3 x 2 ranks does not divide the global batch of 8
    assert main(["study", "run", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "empty after validation" in err and "knobs.micro_batch_size" in err
    assert not (tmp_path / "bad").exists()


def test_unreachable_storage_names_it_without_the_password(tmp_path, capsys):
    path = _study(tmp_path)
    for url, why in (("sqlite:////no/such/folder/study.db", "folder /no/such/folder does not exist"),
                     ("postgresql+psycopg://dsopt:s3cret@127.0.0.1:9/dsopt", "cannot open the study storage")):
        assert main(["study", "run", str(path), "--storage", url]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and why in err, err
        assert "s3cret" not in err
    assert not (tmp_path / "bad").exists()


def test_export_without_a_feasible_trial(tmp_path, capsys):
    path = _study(tmp_path)
    assert main(["export", str(path)]) == 2  # no storage yet
    assert "run 'dsopt study run" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    study = optuna.create_study(study_name="bad", storage=f"sqlite:///{tmp_path / 'bad' / 'study.db'}",
                                directions=["minimize", "maximize"])
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.PRUNED))
    out = tmp_path / "out.json"
    assert main(["export", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no feasible trial" in err
    assert not out.exists()
    assert main(["pareto", str(path), "--storage", "sqlite:////no/such/x.db"]) == 2


def _stored_with_one_feasible_trial(folder: Path) -> Path:
    path = _study(folder)
    (folder / "bad").mkdir()
    study = optuna.create_study(study_name="bad", storage=f"sqlite:///{folder / 'bad' / 'study.db'}",
                                directions=["minimize", "maximize"])
    knobs = {"zero_stage": 2, "offload_optimizer": "none", "offload_param": "none", "precision": "bf16",
             "checkpointing": "full", "micro_batch_size": 2}
    study.add_trial(optuna.trial.create_trial(values=[2e6, 9000.0], user_attrs={"candidate": knobs,
                                                                                "loss_fidelity": 1e-4},
                                              system_attrs={"constraints:loss_fidelity": -0.01}))
    return path


def test_export_writes_a_shareable_file_and_refuses_bad_outputs(tmp_path, capsys):
    import stat

    path = _stored_with_one_feasible_trial(tmp_path)
    out = tmp_path / "cfg.json"
    assert main(["export", str(path), "--pick", "fastest", "--out", str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~_umask()
    assert main(["export", str(path), "--out", str(tmp_path)]) == 2  # a directory
    assert "is a directory" in capsys.readouterr().err
    assert main(["export", str(path), "--storage", f"sqlite:///{tmp_path / 'none.db'}"]) == 2
    assert not (tmp_path / "none.db").exists()  # reading never creates a storage
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["pareto", str(path), "--out", str(blocker)]) == 2


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_study_files_resolve_and_non_utf8_is_refused(tmp_path, monkeypatch):
    import pytest

    from optimizer.study.errors import UserError
    from optimizer.study.study_file import load_study
    from optimizer.study.units import parse_bytes

    path = _study(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert load_study("bad.yaml").path == path.resolve()
    (tmp_path / "latin1.yaml").write_bytes(b"\xff\xfe name: x")
    with pytest.raises(UserError, match="not UTF-8"):
        load_study(tmp_path / "latin1.yaml")
    assert parse_bytes("4.1 GB") == 4_100_000_000 and parse_bytes("2.01 GB") == 2_010_000_000
