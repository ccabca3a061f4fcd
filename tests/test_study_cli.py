"""Bad input for the study commands: one clear line, exit 2, nothing written (no DeepSpeed launch)."""

from __future__ import annotations

from pathlib import Path

import optuna
import yaml

from optimizer.cli import main

ROOT = Path(__file__).resolve().parents[1]


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
    for url in ("sqlite:////no/such/folder/study.db", "postgresql+psycopg://dsopt:s3cret@127.0.0.1:9/dsopt"):
        assert main(["study", "run", str(path), "--storage", url]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "cannot open the study storage" in err
        assert "s3cret" not in err
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


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
