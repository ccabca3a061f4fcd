"""Helpers of the cluster tests: a uniquely named copy of the cluster study, worker processes, the launch log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
CLUSTER_STUDY = ROOT / "studies" / "cluster-cpu.yaml"


def write_cluster_study(folder: Path, **sections) -> Path:
    """A copy of studies/cluster-cpu.yaml with a unique name (shared databases outlive tests) and
    ``sections`` merged in (fast heartbeats for the tests)."""
    raw = yaml.safe_load(CLUSTER_STUDY.read_text())
    raw["name"] = f"cluster-{uuid.uuid4().hex[:8]}"
    for name, value in sections.items():
        raw[name] = {**raw.get(name, {}), **value}
    path = folder / f"{raw['name']}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def start_worker(study: Path, storage: str, log: Path, *extra: str) -> subprocess.Popen:
    """``dsopt worker STUDY --storage URL`` as its own process (stderr and stdout to ``log``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DSOPT_STORAGE", None)
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "optimizer.cli", "worker", str(study), "--storage", storage,
                                 *extra], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def launches(study_dir: Path) -> list[dict]:
    """The launch log (launches.jsonl) the workers appended."""
    path = study_dir / "launches.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate, *, timeout_s: float, interval_s: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
