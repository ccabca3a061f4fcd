"""``dsopt ledger``: table, JSON, --all, and exit code 2 for every user mistake."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from optimizer.cli import main

ROOT = Path(__file__).resolve().parents[3]

GB = 10**9


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_for_one_candidate(capsys, seed_study_path):
    code, out, _ = run(capsys, "ledger", str(seed_study_path), "--set", "zero_stage=2", "--set", "checkpointing=full")
    assert code == 0
    assert "GB = 10^9 bytes" in out
    assert "15.000" in out and "Verdict: FITS" in out


def test_json_has_integer_byte_fields(capsys, seed_study_path):
    code, out, _ = run(capsys, "ledger", str(seed_study_path), "--set", "zero_stage=1",
                       "--set", "offload_optimizer=cpu", "--json")
    assert code == 0
    data = json.loads(out)
    per_gpu = data["per_gpu"]
    for key in ("params", "grads", "optimizer", "activations", "buffers", "total"):
        assert isinstance(per_gpu[key], int), key
    assert per_gpu["total"] == 18 * GB
    assert data["per_host"]["total"] == 8 * GB  # 2 ranks x 4 GB of Adam states
    assert data["nvme"]["total"] == 0
    assert data["fits"] is True
    assert data["candidate"]["zero_stage"] == 1


def test_baseline_without_set_is_the_seed_26gb(capsys, seed_study_path):
    code, out, _ = run(capsys, "ledger", str(seed_study_path), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["per_gpu"]["total"] == 26 * GB and data["fits"] is False
    assert data["reasons"]


def test_all_lists_every_candidate_with_counts(capsys, seed_study_path):
    code, out, _ = run(capsys, "ledger", str(seed_study_path), "--all", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["counts"] == {"total": 32, "valid": 28, "invalid": 4, "fits": 27, "does_not_fit": 1}
    fitting = [c["per_gpu"]["needed"] for c in data["candidates"] if c["valid"] and c["fits"]]
    assert fitting == sorted(fitting)
    assert all(not c["valid"] for c in data["candidates"][-4:])
    code, out, _ = run(capsys, "ledger", str(seed_study_path), "--all")
    assert "28 valid (27 fit, 1 do not fit), 4 invalid, 32 in all" in out


@pytest.mark.slow  # seconds each: a real model trace / a whole study
def test_transformer_study_all(capsys, repo_root):
    code, out, _ = run(capsys, "ledger", str(repo_root / "studies" / "gpt2-tiny-cpu.yaml"), "--all")
    assert code == 0 and "in all" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--set", "zero_stage=0", "--set", "offload_optimizer=cpu"], "invalid combination"),
        (["--set", "zero_stage=7"], "--set: zero_stage: expected 0, 1, 2 or 3"),
        (["--set", "zero=1"], "--set: zero: unknown knob"),
        (["--set", "zero_stage"], "expected knob=value"),
        (["--set", "zero_stage=1", "--set", "zero_stage=2"], "given twice"),
        (["--all", "--set", "zero_stage=1"], "drop --set"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(capsys, seed_study_path, argv, needle):
    code, out, err = run(capsys, "ledger", str(seed_study_path), *argv)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert needle in err


def test_a_baseline_the_study_rules_out_is_blamed_on_the_study_not_on_set(capsys, repo_root, tmp_path):
    # model_init: zero_init needs stage 3, so the default (stage-0) candidate is invalid: a trial without --set
    # names the study file and says what to do (before anything is built); the plan needs no valid baseline, and
    # with --set zero_stage=3 the same study prints that candidate's ledger.
    import yaml

    raw = yaml.safe_load((repo_root / "studies" / "cpu-tiny.yaml").read_text())
    raw["training"]["model_init"] = "zero_init"
    raw["search_space"] = {"knobs": {"zero_stage": [3]}}
    path = tmp_path / "zero-init.yaml"
    path.write_text(yaml.safe_dump(raw))
    code, out, err = run(capsys, "trial", str(path))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert str(path) in err and "baseline" in err and "--set" in err and "zero_init" in err
    assert not err.startswith("dsopt: --set")
    code, out, _ = run(capsys, "ledger", str(path), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["valid"] is False and any("zero_init" in r for r in data["reasons"])
    assert data["plan"]["counts"]["fits"] >= 1
    code, out, _ = run(capsys, "ledger", str(path), "--set", "zero_stage=3")
    assert code == 0
    assert "model construction priced in the init phase: zero_init (training.model_init: zero_init)" in out


def test_console_script_exit_code(seed_study_path, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {kind: seed\n")
    proc = subprocess.run([sys.executable, "-m", "optimizer.cli", "ledger", str(bad)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 2
    assert str(bad) in proc.stderr and "malformed YAML" in proc.stderr
    ok = subprocess.run([sys.executable, "-m", "optimizer.cli", "ledger", str(seed_study_path), "--json"],
                        capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and json.loads(ok.stdout)["per_gpu"]["total"] == 26 * GB


def test_the_ledger_imports_neither_torch_nor_deepspeed():
    code = (
        "import sys; import optimizer.cli, optimizer.ledger.core, optimizer.ledger.model_states, "
        "optimizer.study.study_file; "
        "bad = [m for m in ('torch', 'deepspeed') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_reader_that_stops_early_is_not_an_error():
    # `dsopt ledger --all --json | head -c 100`: ~100 kB of JSON into a pipe whose reader leaves after 100 bytes
    proc = subprocess.Popen([sys.executable, "-m", "optimizer.cli", "ledger", "studies/seed-1b-2x24gb.yaml", "--all",
                             "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(100).startswith(b"{")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "soon"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(value, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["worker", "studies/cpu-tiny.yaml", "--timeout", value])
    assert exited.value.code == 2 and "positive number of seconds" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["empty", "foreign"])
def test_an_empty_or_foreign_sqlite_file_is_left_as_it_was(tmp_path, repo_root, capsys, monkeypatch, content):
    monkeypatch.chdir(repo_root)
    path = tmp_path / "other.db"
    if content == "empty":
        path.touch()
    else:
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE users (name TEXT)")
            db.execute("INSERT INTO users VALUES ('alice')")
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    assert main(["pareto", "studies/cpu-tiny.yaml", "--storage", f"sqlite:///{path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no Optuna study tables" in err
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


@pytest.mark.parametrize("argv", [["ledger"], ["ledger", "studies/cpu-tiny.yaml", "--bogus"], ["frobnicate"],
                                  ["export", "studies/cpu-tiny.yaml", "--pick"]])
def test_a_usage_mistake_is_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and err.startswith("dsopt") and "--help" in err


def test_the_plan_says_which_cuda_defaults_it_took(capsys, tmp_path):
    # a CUDA study that states neither device_reserve nor allocator_overhead is planned with the documented
    # defaults (1 GiB, 0.12), and the output says so; stated figures (0 included) bring no such line
    import yaml

    study = {"model": {"kind": "transformer", "layers": 2, "hidden_size": 64, "heads": 4, "vocab_size": 256,
                       "activations": "formula"},
             "hardware": {"gpus_per_node": 2, "gpu_memory": "16 GiB", "profile": "l4-24gb"},
             "training": {"global_batch_size": 8, "micro_batch_size": 2, "sequence_length": 64},
             "search_space": {"knobs": {"zero_stage": [0, 1]}}}
    path = tmp_path / "cuda.yaml"
    path.write_text(yaml.safe_dump(study))
    code, out, _ = run(capsys, "ledger", str(path))
    assert code == 0
    assert "defaults applied (not in the study file): hardware.device_reserve 1.00 GiB (1.07 GB), " \
           "hardware.allocator_overhead 0.12" in out
    code, out, _ = run(capsys, "ledger", str(path), "--set", "zero_stage=1")
    assert code == 0 and "defaults applied" in out and "device reserve (CUDA context, NCCL)" in out
    study["hardware"] |= {"device_reserve": "0 GiB", "allocator_overhead": 0}
    path.write_text(yaml.safe_dump(study))
    code, out, _ = run(capsys, "ledger", str(path))
    assert code == 0 and "defaults applied" not in out


@pytest.mark.parametrize("command", ["ledger", "trial"])
@pytest.mark.parametrize("bad", [["--set", "zero=1"], ["--set", "zero_stage=7"], ["--set", "micro_batch_size"]])
def test_a_bad_set_writes_nothing(capsys, tmp_path, repo_root, command, bad):
    study = tmp_path / "cpu-tiny.yaml"
    study.write_text((repo_root / "studies" / "cpu-tiny.yaml").read_text())
    before = sorted(tmp_path.rglob("*"))
    code, out, err = run(capsys, command, str(study), *bad)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert sorted(tmp_path.rglob("*")) == before  # no study folder, no trial folder, no half-written file
