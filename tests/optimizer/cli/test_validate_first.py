"""Every command checks all its input before it builds, traces, opens a storage or writes anything (issue 23).

For each command and each class of bad input — the study file, ``--set``, a flag combination, the storage URL,
the devices, the sequence against the model's positions — the command exits 2 with one line, and the study's
folder, the cache folder and the storage are exactly as they were: no file created, changed or removed, and the
steps that build (the parameter inventory, the trace, opening an Optuna storage) never started.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

import launchers.trace.inventory
import launchers.trace.study_traces
import optimizer.search.storage
from optimizer.cli import main
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``folder``."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


class Built(AssertionError):
    """A command started to build or open something before it refused its input."""


@pytest.fixture
def guarded(tmp_path, monkeypatch):
    """A transformers study (llama-tiny-cpu, its config beside it) in a folder of its own, a cache folder, and
    the build steps replaced by ones that fail the test if they are reached."""
    study_dir = tmp_path / "work"
    study_dir.mkdir()
    shutil.copy(ROOT / "studies" / "llama-tiny-cpu.config.json", study_dir)
    raw = yaml.safe_load((ROOT / "studies" / "llama-tiny-cpu.yaml").read_text())
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("DSOPT_CACHE_DIR", str(cache))
    monkeypatch.delenv("DSOPT_STORAGE", raising=False)

    def built(*args, **kwargs):
        raise Built("a build step ran before the input was refused")

    monkeypatch.setattr(launchers.trace.inventory, "take_inventory", built)
    monkeypatch.setattr(launchers.trace.study_traces, "traced_activation", built)
    monkeypatch.setattr(optimizer.search.storage, "open_storage", built)

    def write(**changes) -> Path:
        data = yaml.safe_load(yaml.safe_dump(raw))
        for dotted, value in changes.items():
            section, _, key = dotted.partition("__")
            if key:
                data[section][key] = value
            else:
                data[section] = value
        path = study_dir / "study.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    return study_dir, cache, write


def refused(capsys, guarded, argv: list[str], needle: str) -> None:
    """``dsopt ARGV`` exits 2 with one line holding ``needle``, and nothing changed on disk."""
    study_dir, cache, _ = guarded
    before = snapshot(study_dir), snapshot(cache)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert (snapshot(study_dir), snapshot(cache)) == before


CUDA = {"hardware": {"accelerator": "cuda", "gpus_per_node": 2, "gpu_memory": "24 GiB",
                     "device_reserve": "1 GiB", "allocator_overhead": 0.1}}


@pytest.mark.parametrize(("changes", "extra", "needle"), [
    ({}, ["--set", "zero_stage=4"], "--set: zero_stage"),
    ({}, ["--set", "zero_stage=0", "--set", "offload_optimizer=cpu"], "invalid combination"),
    ({}, ["--set", "precision=fp16"], "invalid combination"),  # fp16 is not among CPU ranks' precisions
    ({}, ["--calibrated", "--set", "zero_stage=1"], "--calibrated"),
    ({}, ["--calibrated", "--json"], "--calibrated"),
    ({}, ["--storage", "sqlite:///x.db"], "only --calibrated"),
    ({}, ["--all", "--set", "zero_stage=1"], "drop --set"),
    ({}, ["--invalid", "--json"], "--invalid"),
    ({}, ["--calibrated"], "no study storage"),
    ({"training__sequence_length": "long"}, [], "training.sequence_length"),
    ({"hardware__bogus": 1}, [], "hardware.bogus: unknown key"),
])
def test_ledger_refuses_before_it_builds(capsys, guarded, changes, extra, needle):
    path = guarded[2](**changes)
    refused(capsys, guarded, ["ledger", str(path), *extra], needle)


def test_a_sequence_past_learned_positions_is_refused_by_every_command(capsys, guarded, repo_root):
    # dsopt's GPT with a 32-row position table at 64 tokens: the real run fails at the embedding lookup
    study_dir, _, _ = guarded
    raw = yaml.safe_load((repo_root / "studies" / "cpu-tiny.yaml").read_text())
    raw["model"]["max_positions"] = 32
    raw["training"]["sequence_length"] = 64
    path = study_dir / "positions.yaml"
    path.write_text(yaml.safe_dump(raw))
    for argv in (["ledger", str(path)], ["ledger", str(path), "--set", "zero_stage=1"], ["trial", str(path)],
                 ["study", "run", str(path)], ["trace", str(path)], ["demo", "--study", str(path)]):
        refused(capsys, guarded, argv, "learned positions")
    raw["training"]["sequence_length"] = 32  # at the table's length it is accepted
    path.write_text(yaml.safe_dump(raw))
    assert load_study(path).model.max_positions == 32


def test_gpt2_config_past_n_positions_names_the_config_key(capsys, guarded):
    study_dir, _, _ = guarded
    config = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512,
              "n_positions": 128}
    path = study_dir / "gpt2.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"kind": "transformer", "hf_config": config}, "hardware": {"accelerator": "cpu",
        "gpus_per_node": 2, "gpu_memory": "4 GiB"}, "training": {"global_batch_size": 4, "micro_batch_size": 2,
        "sequence_length": 256}, "search_space": {"knobs": {"zero_stage": [0, 1]}}}))
    refused(capsys, guarded, ["ledger", str(path)], "n_positions")


@pytest.mark.parametrize(("changes", "extra", "needle"), [
    ({}, ["--set", "checkpointing=every_9"], "invalid combination"),  # past the last of 2 blocks
    ({}, ["--set", "micro_batch_size=3"], "invalid combination"),
    (CUDA, [], "CUDA device"),
    ({"model": {"kind": "seed", "parameters": 1000, "activation_bytes": {"none": "1 MB"}}}, [], "seed-mode"),
])
def test_trial_refuses_before_it_builds(capsys, guarded, changes, extra, needle):
    path = guarded[2](**changes)
    refused(capsys, guarded, ["trial", str(path), *extra], needle)


@pytest.mark.parametrize(("changes", "extra", "needle"), [
    ({}, ["--storage", "mysql://db/x"], "unsupported storage URL"),
    ({}, ["--storage", "journal://relative.log"], "absolute path"),
    ({}, ["--storage", "sqlite:////no/such/folder/x.db"], "does not exist"),
    (CUDA, [], "CUDA device"),
    ({"search_space": {"knobs": {"micro_batch_size": [3]}}}, [], "search space is empty"),
])
def test_study_run_refuses_before_it_builds(capsys, guarded, changes, extra, needle):
    path = guarded[2](**changes)
    refused(capsys, guarded, ["study", "run", str(path), *extra], needle)


@pytest.mark.parametrize(("changes", "extra", "needle"), [
    ({}, [], "workers share a storage"),
    ({}, ["--storage", "sqlite:///x.db"], "SQLite is single-process"),
    (CUDA, ["--storage", "journal:///tmp/dsopt-never-written.log"], "CUDA device"),
])
def test_worker_refuses_before_it_builds(capsys, guarded, changes, extra, needle):
    path = guarded[2](**changes)
    refused(capsys, guarded, ["worker", str(path), *extra], needle)
    assert not Path("/tmp/dsopt-never-written.log").exists()


@pytest.mark.parametrize(("extra", "needle"), [
    (["--workers", "2"], "shared storage is required"),
    (["--workers", "2", "--storage", "sqlite:///x.db"], "SQLite"),
    (["--workers", "2", "--storage", "journal://x.log"], "absolute path"),
])
def test_slurm_submit_refuses_before_it_builds(capsys, guarded, extra, needle):
    path = guarded[2]()
    refused(capsys, guarded, ["slurm", "submit", str(path), *extra], needle)


def test_slurm_submit_without_sbatch_opens_no_storage(capsys, guarded, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no sbatch on PATH
    journal = guarded[0] / "shared.log"
    path = guarded[2]()
    refused(capsys, guarded, ["slurm", "submit", str(path), "--workers", "2", "--storage", f"journal://{journal}"],
            "sbatch")
    assert not journal.exists()


def test_demo_checks_the_devices(capsys, guarded):
    path = guarded[2](**CUDA)
    refused(capsys, guarded, ["demo", "--study", str(path)], "CUDA device")


@pytest.mark.parametrize("command", [["export"], ["pareto"], ["dashboard"]])
def test_readers_refuse_a_missing_storage_and_create_none(capsys, guarded, command):
    path = guarded[2]()
    refused(capsys, guarded, [*command, str(path)], "no study storage")
    refused(capsys, guarded, [*command, str(path), "--storage", f"sqlite:///{guarded[0] / 'absent.db'}"],
            "no such SQLite file")
