"""Cluster pieces that need no service: study-file sections, storage URLs, the sbatch script, refusals."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from launchers.cluster.slurm import sbatch_script
from launchers.trial.local import build_launch_plan
from launchers.trial.node_share import (
    DEFAULT_SLOT,
    WorkerSlot,
    cgroup_dirs,
    cpu_allowance,
    gpu_slice,
    parse_cpu_max,
    parse_slot,
    read_cpu_allowance,
    tasks_on_node,
    visible_gpus,
    worker_slot,
)
from optimizer.cli import main
from optimizer.search.storage import StorageKind, allows_parallel_workers, redact, storage_kind
from optimizer.study.errors import UserError
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]
CLUSTER = ROOT / "studies" / "cluster-cpu.yaml"


def _variant(tmp_path: Path, **sections) -> Path:
    raw = yaml.safe_load(CLUSTER.read_text())
    for name, value in sections.items():
        if value is None:
            raw.pop(name, None)
        else:
            raw[name] = value
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_cluster_sections_load():
    study = load_study(CLUSTER)
    assert study.budget.max_launches == 6 and study.budget.max_hours == 2
    assert (study.workers.heartbeat_s, study.workers.grace_s, study.workers.max_retry) == (10, 40, 2)
    assert study.slurm.time == "01:00:00" and study.slurm.cpus_per_task == 1


def test_defaults_without_cluster_sections(tmp_path):
    study = load_study(_variant(tmp_path, budget=None, workers=None, slurm=None))
    assert study.budget.max_launches is None and study.budget.deadline is None
    assert study.workers.heartbeat_s == 60 and study.workers.grace_s == 180


def test_deadline_is_read_from_yaml_timestamps(tmp_path):
    path = tmp_path / "s.yaml"
    text = CLUSTER.read_text().replace("  max_hours: 2\n", "  deadline: 2026-11-30T07:00:00+01:00\n")
    path.write_text(text)
    assert load_study(path).budget.deadline == datetime(2026, 11, 30, 6, 0, tzinfo=UTC)


@pytest.mark.parametrize(("sections", "key", "needle"), [
    ({"budget": {"max_launches": 0}}, "budget.max_launches", "positive"),
    ({"budget": {"deadline": "2026-11-30T07:00:00"}}, "budget.deadline", "timezone"),
    ({"budget": {"deadline": "tomorrow"}}, "budget.deadline", "ISO 8601"),
    ({"budget": {"max_trials": 3}}, "budget.max_trials", "unknown key"),
    ({"workers": {"heartbeat_s": 10, "grace_s": 5}}, "workers.grace_s", "larger than heartbeat_s"),
    ({"slurm": {"sbatch": ["qos=normal"]}}, "slurm.sbatch", "--option"),
    ({"slurm": {"partiton": "gpu"}}, "slurm.partiton", "unknown key"),
    ({"slurm": {"partition": "gpu\necho INJECTED"}}, "slurm.partition", "one word"),  # a line of its own in the script
    ({"slurm": {"account": "a b"}}, "slurm.account", "one word"),
    ({"slurm": {"time": ""}}, "slurm.time", "not a SLURM time"),
    ({"slurm": {"python": "python3\nrm -rf ~"}}, "slurm.python", "one line"),
])
def test_bad_cluster_sections_name_the_key(tmp_path, sections, key, needle):
    with pytest.raises(UserError) as err:
        load_study(_variant(tmp_path, **sections))
    assert err.value.key == key and needle in err.value.why


def test_storage_kinds_and_redaction():
    assert storage_kind("sqlite:////x/study.db") is StorageKind.SQLITE
    assert storage_kind("postgresql+psycopg://u:p@h/db") is StorageKind.POSTGRESQL
    assert storage_kind("postgresql://u@h/db") is StorageKind.POSTGRESQL
    assert storage_kind("journal:///shared/s.log") is StorageKind.JOURNAL
    assert not allows_parallel_workers("sqlite:///x.db") and allows_parallel_workers("journal:///x.log")
    with pytest.raises(UserError, match="unsupported storage URL") as err:
        storage_kind("mysql://root:hunter2@h/db")
    assert "hunter2" not in str(err.value)
    assert redact("postgresql+psycopg://dsopt:s3cret@10.0.0.1:5432/db") == "postgresql+psycopg://dsopt:***@10.0.0.1:5432/db"


def test_worker_refuses_sqlite_and_missing_storage(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DSOPT_STORAGE", raising=False)
    path = _variant(tmp_path)
    assert main(["worker", str(path), "--storage", f"sqlite:///{tmp_path / 'x.db'}"]) == 2
    err = capsys.readouterr().err
    assert "SQLite is single-process" in err and len(err.strip().splitlines()) == 1
    assert main(["worker", str(path)]) == 2
    assert "DSOPT_STORAGE" in capsys.readouterr().err
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "cluster-cpu").exists()


def test_journal_url_needs_an_existing_folder(tmp_path, capsys):
    path = _variant(tmp_path)
    assert main(["worker", str(path), "--storage", "journal:///no/such/folder/s.log"]) == 2
    assert "existing folder" in capsys.readouterr().err


def test_slurm_status_on_a_missing_journal_creates_nothing(tmp_path, capsys):
    path = _variant(tmp_path)
    journal = tmp_path / "none.log"
    assert main(["slurm", "status", str(path), "--storage", f"journal://{journal}"]) == 2
    err = capsys.readouterr().err
    assert "no such journal file" in err and len(err.strip().splitlines()) == 1
    assert not journal.exists()


def test_unreachable_postgres_is_one_line_without_the_password(tmp_path, capsys):
    path = _variant(tmp_path)
    # Port 1 on loopback: nothing listens there.
    code = main(["worker", str(path), "--storage", "postgresql+psycopg://dsopt:topsecret@127.0.0.1:1/dsopt"])
    err = capsys.readouterr().err
    assert code == 2 and "topsecret" not in err and "***" in err and len(err.strip().splitlines()) == 1


def test_sbatch_script_snapshot():
    study = load_study(CLUSTER)
    script = sbatch_script(spec=study, workers=4, python="/opt/venv/bin/python", workdir=Path("/repo"),
                           log_dir=Path("/repo/studies/cluster-cpu/slurm"))
    assert script.splitlines() == [
        "#!/bin/bash",
        f"# dsopt workers for study 'cluster-cpu' ({CLUSTER}): one worker per array task.",
        "# The storage URL is read from $DSOPT_STORAGE in the job's environment; it is never written here.",
        "#SBATCH --job-name=dsopt-cluster-cpu",
        "#SBATCH --array=0-3",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --output=/repo/studies/cluster-cpu/slurm/%A_%a.out",
        "#SBATCH --chdir=/repo",
        "#SBATCH --time=01:00:00",
        "#SBATCH --cpus-per-task=1",
        "set -euo pipefail",
        ': "${DSOPT_STORAGE:?DSOPT_STORAGE is not set in the job environment}"',
        f"exec /opt/venv/bin/python -m optimizer.cli worker {CLUSTER}",
    ]


def test_gpu_multi_node_sbatch_options(tmp_path):
    raw = yaml.safe_load((ROOT / "studies" / "llama-7b-8xh100.yaml").read_text())
    raw["hardware"]["nodes"] = 2
    raw["search_space"] = str(ROOT / "search_spaces" / "default.yaml")
    raw["slurm"] = {"partition": "h100", "account": "proj", "mem": 0, "sbatch": ["--exclusive"],
                    "setup": ["module load cuda/12.4"]}
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(raw))
    study = load_study(path)
    script = sbatch_script(spec=study, workers=2, python="py", workdir=Path("/r"), log_dir=Path("/r/l"))
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=h100",
                 "#SBATCH --account=proj", "#SBATCH --mem=0", "#SBATCH --exclusive", "module load cuda/12.4"):
        assert line in script.splitlines()


def test_dry_run_prints_and_writes_nothing(tmp_path, capsys):
    path = _variant(tmp_path)
    assert main(["slurm", "submit", str(path), "--workers", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --array=0-1" in out and "worker" in out
    assert not (tmp_path / "cluster-cpu").exists()


def test_submit_refuses_sqlite(tmp_path, capsys):
    path = _variant(tmp_path)
    assert main(["slurm", "submit", str(path), "--workers", "2", "--storage", "sqlite:///x.db"]) == 2
    assert "SQLite" in capsys.readouterr().err
    assert not (tmp_path / "cluster-cpu").exists()


def test_multi_node_plan_uses_srun_and_c10d_rendezvous():
    plan = build_launch_plan(python="py", ranks=8, cpu_ranks=False, master_port=29500, plan_path=Path("/t/p.json"),
                             out_dir=Path("/t"), base_env={}, pythonpath=["/repo"], cwd=Path("/repo"), cpu_count=64,
                             launch_id="0123456789abcdef", extensions_dir=Path("/e"), parent_pid=42, nodes=2,
                             head_host="node07")
    assert plan.argv == (
        "py", "-m", "launchers.process.orphan_guard", "42",
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=64", "--kill-on-bad-exit=1",
        "--export=ALL", "--job-name=dsopt-trial-01234567",
        "py", "-m", "launchers.process.collector", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "8",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "node07:29500", "--rdzv_id", "0123456789abcdef",
        "-m", "launchers.rank.trial_rank", "/t/p.json", "/t",
    )
    assert plan.env["OMP_NUM_THREADS"] == "8"


def test_multi_node_srun_takes_the_study_cpus_per_task():
    """SLURM >= 22.05: srun no longer inherits --cpus-per-task (22.05 release notes), so the plan passes it."""
    plan = build_launch_plan(python="py", ranks=8, cpu_ranks=False, master_port=1, plan_path=Path("/t/p.json"),
                             out_dir=Path("/t"), base_env={}, pythonpath=["/repo"], cwd=Path("/repo"), cpu_count=4,
                             launch_id="0123456789abcdef", extensions_dir=Path("/e"), nodes=2, head_host="n",
                             cpus_per_task=32, gpus=("0", "1"))
    assert "--cpus-per-task=32" in plan.argv and plan.env["OMP_NUM_THREADS"] == "4"
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_multi_node_study_outside_slurm_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    raw = yaml.safe_load(CLUSTER.read_text())
    raw["hardware"]["nodes"] = 2
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["trial", str(path)]) == 2
    err = capsys.readouterr().err
    assert "hardware.nodes" in err and "srun" in err


# --- one node, several workers: GPU slices (launchers/trial/node_share.py) ---

EIGHT = tuple(str(i) for i in range(8))


def test_gpu_slices_of_the_workers_on_a_node_are_disjoint():
    slices = [gpu_slice(visible=EIGHT, gpus_per_trial=2, slot=WorkerSlot(index=k, workers_on_node=4, source="t"))
              for k in range(4)]
    assert slices == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
    assert gpu_slice(visible=EIGHT, gpus_per_trial=8, slot=DEFAULT_SLOT) == EIGHT


def test_gpu_slices_are_cut_from_an_existing_cuda_visible_devices():
    visible = visible_gpus(cuda_visible="4,5, 6,7", device_count=4)
    assert gpu_slice(visible=visible, gpus_per_trial=2, slot=parse_slot("1")) == ("6", "7")
    uuids = visible_gpus(cuda_visible="GPU-aa,GPU-bb,bogus,GPU-cc", device_count=2)  # CUDA stops at 'bogus'
    assert uuids == ("GPU-aa", "GPU-bb")
    assert visible_gpus(cuda_visible=None, device_count=3) == ("0", "1", "2")
    assert visible_gpus(cuda_visible="", device_count=0) == ()


@pytest.mark.parametrize(
    ("slot", "needle"),
    [
        (WorkerSlot(index=4, workers_on_node=None, source="--slot"), "--slot: 4: slot 4 needs visible GPUs 8..9"),
        (WorkerSlot(index=0, workers_on_node=5, source="$SLURM_LOCALID"), "slices would overlap (room for 4"),
    ],
)
def test_gpu_slices_past_the_node_or_overlapping_are_refused(slot, needle):
    with pytest.raises(UserError) as err:
        gpu_slice(visible=EIGHT, gpus_per_trial=2, slot=slot)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_slot_option_and_slurm_step_resolution():
    assert parse_slot("2/4") == WorkerSlot(index=2, workers_on_node=4, source="--slot")
    for bad in ("4/4", "-1", "x", "1/"):
        with pytest.raises(ValueError, match="K"):
            parse_slot(bad)
    step = {"SLURM_STEP_ID": "0", "SLURM_LOCALID": "3", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2,4(x2)"}
    assert worker_slot(explicit=None, env=step) == WorkerSlot(index=3, workers_on_node=4, source="$SLURM_LOCALID")
    assert worker_slot(explicit=parse_slot("1"), env=step).index == 1
    batch = {"SLURM_JOB_ID": "7", "SLURM_LOCALID": "0", "SLURM_ARRAY_TASK_ID": "3"}  # a job array's task
    assert worker_slot(explicit=None, env=batch) == DEFAULT_SLOT
    assert worker_slot(explicit=None, env={**step, "SLURM_GPUS_PER_TASK": "2"}) == DEFAULT_SLOT  # SLURM binds
    assert tasks_on_node("4(x2),2", 2) == 2 and tasks_on_node("4(x2)", 2) is None and tasks_on_node("?", 0) is None


def test_launch_plan_env_carries_the_gpu_slice_and_cpu_ranks_see_none():
    common = {"python": "py", "ranks": 2, "master_port": 1, "plan_path": Path("p"), "out_dir": Path("o"),
              "base_env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "pythonpath": ["/r"], "cwd": Path("."),
              "cpu_count": 8, "launch_id": "id", "extensions_dir": Path("/e"), "gpus": ("2", "3")}
    assert build_launch_plan(cpu_ranks=False, **common).env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert build_launch_plan(cpu_ranks=True, **common).env["CUDA_VISIBLE_DEVICES"] == ""
    assert build_launch_plan(cpu_ranks=False, **{**common, "gpus": None}).env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_worker_slot_past_the_node_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    import torch

    raw = yaml.safe_load(CLUSTER.read_text())
    raw["hardware"] = {"accelerator": "cuda", "gpus_per_node": 2, "gpu_memory": "80 GB"}
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    code = main(["worker", str(path), "--storage", f"journal:///{tmp_path}/j.log", "--slot", "2"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--slot: 2: slot 2 needs visible GPUs 4..5; this node shows 4 (0,1,2,3)" in err


# --- threads from the CPUs the process may use ---

def test_cgroup_cpu_max_parser():
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("150000 100000") == 1.5
    assert parse_cpu_max("400000 100000\n") == 4.0
    for bad in ("", "abc 100000", "0 100000", "1 2 3"):
        with pytest.raises(ValueError, match=r"cpu\.max"):
            parse_cpu_max(bad)
    assert cgroup_dirs("12:cpu:/x\n0::/slurm/job_7/step_0\n") == ["/slurm/job_7/step_0", "/slurm/job_7", "/slurm",
                                                                  "/"]
    assert cgroup_dirs("4:memory:/x\n") == []
    assert cgroup_dirs("0::/\n") == ["/"]


def test_cpu_allowance_is_affinity_capped_by_the_quota_rounded_up():
    assert cpu_allowance(affinity=16, quotas=[]) == 16
    assert cpu_allowance(affinity=16, quotas=[None, 1.5]) == 2
    assert cpu_allowance(affinity=16, quotas=[8.0, 3.0]) == 3  # the tightest cgroup on the way up
    assert cpu_allowance(affinity=4, quotas=[8.0]) == 4
    assert cpu_allowance(affinity=1, quotas=[0.2]) == 1
    import os

    assert 1 <= read_cpu_allowance() <= len(os.sched_getaffinity(0))


# --- JIT-build locks: only those provably orphaned on this node (launchers/ops/build_locks.py) ---


