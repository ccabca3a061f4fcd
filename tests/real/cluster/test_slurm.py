"""``dsopt slurm submit`` / ``dsopt slurm status`` on a real one-node SLURM (slurm-wlm + munge, started by
``.ci/services``), workers sharing a real PostgreSQL study; and a multi-node trial started with srun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import optuna
import pytest
from cluster_helpers import ROOT, launches, wait_for, write_cluster_study

from optimizer.search.storage import open_storage
from optimizer.study.study_file import load_study

pytestmark = pytest.mark.slow


def _dsopt(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "optimizer.cli", *argv], env=env, cwd=ROOT, capture_output=True,
                          text=True, check=False, timeout=120)


def test_submit_runs_a_two_worker_array_to_completion(tmp_path, postgres_url, slurm_conf):
    path = write_cluster_study(tmp_path, budget={"max_launches": 5},  # the FP32 reference + 4 trials
                               workers={"heartbeat_s": 2, "grace_s": 8})
    env = {**os.environ, "SLURM_CONF": slurm_conf, "DSOPT_STORAGE": postgres_url}
    submitted = _dsopt("slurm", "submit", str(path), "--workers", "2", env=env)
    assert submitted.returncode == 0, submitted.stderr
    assert "dsopt:dsopt@" not in submitted.stdout and "***" in submitted.stdout
    job_id = submitted.stdout.split("submitted job array ")[1].split(":")[0]
    script = (tmp_path / path.stem / "slurm" / "worker.sbatch").read_text()
    assert "#SBATCH --array=0-1" in script and "dsopt:dsopt" not in script  # no password in the file

    def array_done() -> bool:
        queue = subprocess.run(["squeue", "-h", "-r", "-j", job_id], env=env, capture_output=True, text=True)
        return queue.returncode == 0 and not queue.stdout.strip()

    wait_for(array_done, timeout_s=600, interval_s=2, what=f"SLURM array {job_id} to finish")
    outs = {task: (tmp_path / path.stem / "slurm" / f"{job_id}_{task}.out").read_text() for task in (0, 1)}
    assert all("stopping:" in text for text in outs.values()), outs

    spec = load_study(path)
    stored = optuna.load_study(study_name=spec.name, storage=open_storage(postgres_url, workers=spec.workers))
    workers = {t.user_attrs.get("worker") for t in stored.get_trials()}
    assert {w.rsplit("/", 1)[1] for w in workers if w} <= {f"{job_id}_0", f"{job_id}_1"}
    started = [r for r in launches(tmp_path / path.stem) if r["event"] == "start"
               and not r["trial_dir"].endswith("/reference")]
    assert len(started) == 4 and len({json.dumps(r["candidate"], sort_keys=True) for r in started}) == 4
    assert stored.best_trials

    status = _dsopt("slurm", "status", str(path), env=env)
    assert status.returncode == 0, status.stderr
    assert f"job {job_id}: 2 worker(s)" in status.stdout and "total" in status.stdout
    assert "dsopt:dsopt@" not in status.stdout
    assert any(f"/{job_id}_" in line for line in status.stdout.splitlines())


def test_a_two_node_trial_starts_one_torchrun_agent_per_node_with_srun(tmp_path, slurm_conf):
    """hardware.nodes: 2 inside a SLURM allocation: srun starts 2 torchrun agents that meet through the c10d
    rendezvous. The one-node test cluster carries both agents (slurm_nodes=1); on a real cluster each agent
    is on its own node (the plan's --ntasks-per-node=1, tested in tests/launchers/cluster/test_cluster_units.py)."""
    path = write_cluster_study(tmp_path, hardware={"nodes": 2})
    script = tmp_path / "two_nodes.py"
    script.write_text(
        "import json, sys\n"
        "from launchers.trial.run import result_json, run_trial\n"
        "from optimizer.study.specs import baseline_candidate\n"
        "from optimizer.study.study_file import load_study\n"
        "study = load_study(sys.argv[1])\n"
        "result = run_trial(study=study, candidate=baseline_candidate(study.training), slurm_nodes=1)\n"
        "print('RESULT', json.dumps(result_json(result)))\n")
    env = {**os.environ, "SLURM_CONF": slurm_conf, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "job.out"
    job = subprocess.run(["sbatch", "--wait", "--nodes=1", "--ntasks=2", f"--output={out}", f"--chdir={ROOT}",
                          "--wrap", f"{sys.executable} {script} {path}"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert job.returncode == 0, (job.stderr, out.read_text() if out.exists() else "")
    result = json.loads(out.read_text().split("RESULT ", 1)[1])
    assert result["outcome"] == "ok" and len(result["ranks"]) == 2
    trial_dir = next((tmp_path / path.stem / "trials").iterdir())
    reports = [json.loads((trial_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(r["node_rank"] for r in reports) == [0, 1]  # two agents ("nodes"), one rank each
