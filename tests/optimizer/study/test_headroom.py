"""``budget.headroom``: read from the study file, defaulted per accelerator, and kept by the exported pick
(the Pareto front still shows every measured point; only the pick keeps the headroom)."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml

from optimizer.cli import main
from optimizer.results.pareto import front_table, pick_trial
from optimizer.study.cluster_settings import HEADROOM_CPU, HEADROOM_CUDA, BudgetSettings, Headroom
from optimizer.study.errors import UserError
from optimizer.study.specs import Accelerator
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]
GB = 10**9
BUDGET_BYTES = 80 * GB


def _study_file(folder: Path, *, accelerator: str = "cuda", headroom: object = None) -> Path:
    """studies/demo-cpu.yaml as an 80 GB-per-device study on ``accelerator``, with ``budget.headroom`` if given."""
    raw = yaml.safe_load((ROOT / "studies" / "demo-cpu.yaml").read_text())
    raw["name"] = "roomy"
    raw["model"]["activations"] = "formula"  # no trace: dsopt demo would trace the model first
    raw["hardware"] = {"accelerator": accelerator, "gpus_per_node": 2, "gpu_memory": "80 GB"}
    if headroom is not None:
        raw["budget"] = {"headroom": headroom}
    path = folder / "roomy.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# Reading


@pytest.mark.parametrize(("written", "fraction"), [
    ("0.05", 0.05), ("'5 %'", 0.05), ("5%", 0.05), ("'2.5 %'", 0.025), ("0", 0.0), ("'0 %'", 0.0), ("1e-2", 0.01),
])
def test_headroom_reads_a_fraction_or_a_percentage(tmp_path, written, fraction):
    path = _study_file(tmp_path)
    path.write_text(path.read_text() + f"budget:\n  headroom: {written}\n")
    study = load_study(path)
    assert study.budget.headroom == pytest.approx(fraction)
    headroom = study.budget.headroom_for(study.hardware.accelerator)
    assert headroom.stated and headroom.fraction == pytest.approx(fraction)
    assert headroom.basis == "stated in budget.headroom"


@pytest.mark.parametrize(("written", "why"), [
    ("-0.05", "must be >= 0 and < 1"), ("'-5 %'", "must be >= 0 and < 1"), ("1", "must be >= 0 and < 1"),
    ("1.5", "write '1.5 %'"), ("5", "for 5 percent write '5 %'"), ("'100 %'", "must be >= 0 and < 1"),
    ("lots", "expected a fraction"), ("'5 percent'", "expected a fraction"), ("true", "expected a fraction"),
    (".nan", "expected a fraction"), ("[5]", "expected a fraction"),
])
def test_bad_headroom_names_the_file_and_the_key(tmp_path, written, why):
    path = _study_file(tmp_path)
    path.write_text(path.read_text() + f"budget:\n  headroom: {written}\n")
    with pytest.raises(UserError) as info:
        load_study(path)
    assert (info.value.source, info.value.key) == (str(path), "budget.headroom")
    assert why in info.value.why


def test_bad_headroom_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys):
    path = _study_file(tmp_path, accelerator="cpu", headroom="lots")
    assert main(["export", str(path), "--out", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and "budget.headroom" in err and "'lots'" in err
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "roomy").exists()


def test_the_default_depends_on_the_accelerator(tmp_path):
    assert (HEADROOM_CUDA, HEADROOM_CPU) == (0.05, 0.03)
    for accelerator, fraction, basis in (("cuda", 0.05, "default on GPUs; budget.headroom"),
                                         ("cpu", 0.03, "default on CPU ranks; budget.headroom")):
        study = load_study(_study_file(tmp_path, accelerator=accelerator))
        assert study.budget.headroom is None  # not stated: the spec says so
        headroom = study.budget.headroom_for(study.hardware.accelerator)
        assert (headroom.fraction, headroom.stated, headroom.basis) == (fraction, False, basis)
    stated = BudgetSettings(headroom=0.0).headroom_for(Accelerator.CUDA)
    assert (stated.fraction, stated.stated) == (0.0, True)  # 0 is a stated headroom, not "use the default"


def test_usable_bytes_and_the_headroom_range():
    assert Headroom(fraction=0.05, stated=False, accelerator=Accelerator.CUDA).usable_bytes(BUDGET_BYTES) == 76 * GB
    assert Headroom(fraction=0.0, stated=True, accelerator=Accelerator.CPU).usable_bytes(3_000_000) == 3_000_000
    for bad in (-0.01, 1.0, float("nan")):
        with pytest.raises(ValueError, match="headroom"):
            Headroom(fraction=bad, stated=True, accelerator=Accelerator.CUDA)
        with pytest.raises(ValueError, match="headroom"):
            BudgetSettings(headroom=bad)


# The pick

FRONT = (  # (memory objective in bytes per device, tokens/s, label): a Pareto front, the fastest at 98 %
    (30 * GB, 1000.0, "z3 bf16 ckpt=full mbs=1"),
    (50 * GB, 2000.0, "z3 bf16 ckpt=full mbs=2"),
    (70 * GB, 2500.0, "z2 bf16 ckpt=full mbs=2"),
    (78_400_000_000, 3000.0, "z2 bf16 ckpt=none mbs=2"),  # 98 % of 80 GB
)
KNOBS = {"zero_stage": 2, "offload_optimizer": "none", "offload_param": "none", "precision": "bf16",
         "checkpointing": "full", "micro_batch_size": 2}


def _add_front(study: optuna.Study, points=FRONT) -> None:
    for memory_bytes, tokens_per_s, label in points:
        study.add_trial(optuna.trial.create_trial(
            values=[memory_bytes, tokens_per_s],
            user_attrs={"label": label, "candidate": KNOBS, "loss_fidelity": 1e-3},
            system_attrs={"constraints:loss_fidelity": -0.01}))


def _in_memory(points=FRONT) -> optuna.Study:
    study = optuna.create_study(study_name="roomy", directions=["minimize", "maximize"])
    _add_front(study, points)
    return study


def _headroom(fraction: float) -> Headroom:
    return Headroom(fraction=fraction, stated=True, accelerator=Accelerator.CUDA)


def _pick(study: optuna.Study, how: str, fraction: float) -> str:
    return pick_trial(study, how, budget_bytes=BUDGET_BYTES, headroom=_headroom(fraction)).user_attrs["label"]


def test_the_picks_keep_the_headroom():
    study = _in_memory()
    assert _pick(study, "fastest", 0.05) == "z2 bf16 ckpt=full mbs=2"  # the 98 % point is left out
    assert _pick(study, "fastest", 0.0) == "z2 bf16 ckpt=none mbs=2"  # headroom 0: the 98 % point
    assert _pick(study, "fastest", 0.02) == "z2 bf16 ckpt=none mbs=2"  # 78.4 GB ≤ 80 − 1.6 GB: within, exactly
    assert _pick(study, "fastest", 0.021) == "z2 bf16 ckpt=full mbs=2"
    assert _pick(study, "smallest", 0.05) == "z3 bf16 ckpt=full mbs=1"
    assert _pick(study, "balanced", 0.05) == "z3 bf16 ckpt=full mbs=2"
    for fraction in (0.0, 0.02, 0.05, 0.15, 0.3, 0.5):  # 0.5: only the 30 GB point is within 40 GB
        for how in ("fastest", "smallest", "balanced"):
            picked = pick_trial(study, how, budget_bytes=BUDGET_BYTES, headroom=_headroom(fraction))
            assert picked.values[0] <= BUDGET_BYTES * (1 - fraction), (how, fraction)
    assert pick_trial(study, "trial=3", budget_bytes=BUDGET_BYTES, headroom=_headroom(0.05)).number == 3
    assert pick_trial(study, "fastest").number == 3  # no budget given: every front point (launchers/study/demo.py)


def test_no_front_point_within_the_headroom_is_a_user_error():
    study = _in_memory(FRONT[2:])
    with pytest.raises(UserError) as info:
        pick_trial(study, "smallest", budget_bytes=BUDGET_BYTES, headroom=_headroom(0.2))
    assert info.value.key == "budget.headroom"
    why = info.value.why
    assert "none of the 2 front point(s) measured ≤ 64.000 GB (GB = 10^9 bytes)" in why
    assert "trial #0 z2 bf16 ckpt=full mbs=2, measured 70.000 GB (87.5 % of the budget)" in why
    assert "--pick trial=0" in why
    with pytest.raises(ValueError, match="together"):
        pick_trial(study, "smallest", budget_bytes=BUDGET_BYTES)


def test_the_front_table_marks_the_rows_above_the_headroom():
    table = front_table(_in_memory(), budget_bytes=BUDGET_BYTES, headroom=_headroom(0.05)).splitlines()
    assert table[2] == ("  headroom 5 % kept free (stated in budget.headroom): the export picks only among rows "
                        "measured ≤ 76,000.000 MB (within = yes)")
    assert table[3].split() == ["trial", "train", "MB", "tokens/s", "fidelity", "within", "candidate"]
    assert [row.split()[4] for row in table[4:]] == ["yes", "yes", "yes", "no"]
    assert "within" not in front_table(_in_memory(), budget_bytes=BUDGET_BYTES)


# dsopt export and dsopt pareto on a stored study


def _printed(capsys) -> list[str]:
    """What the command printed from its first line on (DeepSpeed's import may print its accelerator first)."""
    lines = capsys.readouterr().out.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("picked trial")):]


def _stored(folder: Path, **study_file) -> Path:
    path = _study_file(folder, **study_file)
    (folder / "roomy").mkdir()
    study = optuna.create_study(study_name="roomy", storage=f"sqlite:///{folder / 'roomy' / 'study.db'}",
                                directions=["minimize", "maximize"])
    _add_front(study)
    return path


def test_export_prints_the_headroom_and_what_it_left_out(tmp_path, capsys):
    path = _stored(tmp_path)
    out = tmp_path / "fastest.json"
    assert main(["export", str(path), "--pick", "fastest", "--out", str(out)]) == 0
    lines = _printed(capsys)
    assert lines[0] == "picked trial #2 (fastest): z2 bf16 ckpt=full mbs=2"
    assert lines[2] == ("headroom: 5 % of the 80.000 GB budget kept free (default on GPUs; budget.headroom) → picks "
                        "among 3 of 4 front points measured ≤ 76.000 GB (GB = 10^9 bytes, per device)")
    assert lines[3] == "left out, measured above 76.000 GB: trial #3 z2 bf16 ckpt=none mbs=2 (98.0 % of the budget)"
    assert lines[4].startswith(f"wrote {out}") and out.exists()


def test_export_with_headroom_0_picks_the_98_percent_point(tmp_path, capsys):
    path = _stored(tmp_path, headroom=0)
    assert main(["export", str(path), "--pick", "fastest", "--out", str(tmp_path / "x.json")]) == 0
    lines = _printed(capsys)
    assert lines[0] == "picked trial #3 (fastest): z2 bf16 ckpt=none mbs=2"
    assert lines[2] == ("headroom: 0 % of the 80.000 GB budget kept free (stated in budget.headroom) → picks among "
                        "4 of 4 front points measured ≤ 80.000 GB (GB = 10^9 bytes, per device)")
    assert lines[3].startswith("wrote ")


def test_export_of_a_named_trial_above_the_headroom_warns_by_how_much(tmp_path, capsys):
    path = _stored(tmp_path)
    assert main(["export", str(path), "--pick", "trial=3", "--out", str(tmp_path / "x.json")]) == 0
    lines = _printed(capsys)
    assert lines[0] == "picked trial #3 (trial=3): z2 bf16 ckpt=none mbs=2"
    assert lines[4] == ("warning: trial #3 measured 78.400 GB (98.0 % of the budget), 2.400 GB (3.0 % of the budget) "
                        "above the headroom's 76.000 GB; exported because --pick trial=3 names it")


def test_export_with_no_front_point_within_the_headroom_writes_nothing(tmp_path, capsys):
    path = _stored(tmp_path, headroom="99 %")
    out = tmp_path / "x.json"
    assert main(["export", str(path), "--pick", "balanced", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "budget.headroom" in err and "≤ 0.800 GB" in err
    assert "trial #0 z3 bf16 ckpt=full mbs=1, measured 30.000 GB (37.5 % of the budget)" in err
    assert not out.exists()


def test_pareto_marks_the_rows_above_the_headroom(tmp_path, capsys):
    path = _stored(tmp_path, accelerator="cpu")
    assert main(["pareto", str(path), "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out.splitlines()
    table = out[next(i for i, line in enumerate(out) if line.startswith("study roomy")):]
    assert "headroom 3 % kept free (default on CPU ranks; budget.headroom)" in table[2]
    assert "77,600.000 MB" in table[2]
    assert [row.split()[4] for row in table[4:8]] == ["yes", "yes", "yes", "no"]


def test_the_demo_pick_line_mentions_the_headroom(tmp_path, capsys, monkeypatch):
    import launchers.study.demo

    path = _stored(tmp_path, accelerator="cpu")
    stored = optuna.load_study(study_name="roomy", storage=f"sqlite:///{tmp_path / 'roomy' / 'study.db'}")
    picked = stored.get_trials()[3]  # a pick made without the headroom (launchers/study/demo.py's today): 98 %

    def run_demo(*, spec, n_trials):
        return launchers.study.demo.DemoResult(study=stored, picked=picked, config_path=tmp_path / "c.json",
                                         png_path=tmp_path / "p.png", html_path=tmp_path / "p.html",
                                         counts={"measured": 4, "reused": 0, "pruned": 0, "held": 0, "failed": 0},
                                         wall_s=1.0)

    monkeypatch.setattr(launchers.study.demo, "run_demo", run_demo)
    assert main(["demo", "--study", str(path), "--n-trials", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = out[next(i for i, line in enumerate(out) if line.startswith("picked (balanced)")):]
    assert lines[1] == ("headroom: 3 % of the 80.000 GB budget kept free (default on CPU ranks; budget.headroom) → "
                        "picks among 3 of 4 front points measured ≤ 77.600 GB (GB = 10^9 bytes, per device)")
    assert lines[3] == ("warning: trial #3 measured 78.400 GB (98.0 % of the budget), 0.800 GB (1.0 % of the budget) "
                        "above the headroom's 77.600 GB; picked without the headroom (dsopt export --pick balanced "
                        "picks within it)")
