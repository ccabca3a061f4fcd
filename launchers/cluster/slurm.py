"""``dsopt slurm submit`` and ``dsopt slurm status``: the study's workers as a SLURM job array.

One array task = one worker (``dsopt worker``) holding ``hardware.nodes`` node(s) with
``hardware.gpus_per_node`` GPUs each; all tasks share the study through its storage (PostgreSQL or a
journal file), so the study's global budget, not the array size, bounds the work. The script is built by a
pure function (:func:`sbatch_script`), written to ``studies/NAME/slurm/worker.sbatch`` and submitted with
``sbatch --parsable``; job ids are recorded in ``studies/NAME/slurm/jobs.json`` for ``dsopt slurm status``.

The storage URL is never written into the script: ``sbatch`` hands the submitting environment to the job
(``--export=ALL``, SLURM's default), and the script reads ``$DSOPT_STORAGE`` from it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import optuna

from optimizer.search import storage as storages  # open_storage looked up at call time (tests guard it)
from optimizer.search.coordination import WORKER_ATTR, now_utc
from optimizer.search.storage import (
    allows_parallel_workers,
    check_readable,
    check_storage_url,
    redact,
    storage_error,
)
from optimizer.study.errors import UserError
from optimizer.study.specs import Accelerator
from optimizer.study.study_file import StudySpec

STORAGE_VAR = "DSOPT_STORAGE"
"""Environment variable carrying the storage URL to the workers (and read by ``dsopt`` when no --storage)."""
REPO_ROOT = Path(__file__).resolve().parents[2]


def slurm_dir(spec: StudySpec) -> Path:
    """``studies/NAME/slurm/``: the script, the jobs file and the array tasks' logs."""
    return spec.output_dir / "slurm"


def sbatch_script(*, spec: StudySpec, workers: int, python: str, workdir: Path, log_dir: Path) -> str:
    """The sbatch script of a ``workers``-task array running ``dsopt worker`` on the study (pure)."""
    hw, slurm = spec.hardware, spec.slurm
    options = [
        f"--job-name=dsopt-{spec.name}",
        f"--array=0-{workers - 1}",
        f"--nodes={hw.nodes}",
        "--ntasks-per-node=1",
        f"--output={log_dir}/%A_%a.out",
        f"--chdir={workdir}",
    ]
    if hw.accelerator is Accelerator.CUDA:
        options.append(f"--gpus-per-node={hw.gpus_per_node}")
    for flag, value in (("partition", slurm.partition), ("account", slurm.account), ("time", slurm.time),
                        ("cpus-per-task", slurm.cpus_per_task), ("mem", slurm.mem)):
        if value is not None:
            options.append(f"--{flag}={value}")
    options.extend(slurm.sbatch)
    lines = [
        "#!/bin/bash",
        f"# dsopt workers for study '{spec.name}' ({spec.path}): one worker per array task.",
        f"# The storage URL is read from ${STORAGE_VAR} in the job's environment; it is never written here.",
        *(f"#SBATCH {option}" for option in options),
        "set -euo pipefail",
        *slurm.setup,
        f': "${{{STORAGE_VAR}:?{STORAGE_VAR} is not set in the job environment}}"',
        f"exec {shlex.quote(python)} -m optimizer.cli worker {shlex.quote(str(spec.path))}",
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, kw_only=True, slots=True)
class Submission:
    """What ``dsopt slurm submit`` did."""

    script: str
    """The sbatch script."""
    script_path: Path | None
    """Where it was written (None on --dry-run)."""
    job_id: str | None
    """SLURM's job id (None on --dry-run)."""


def check_submission(storage: str | None) -> tuple[str, str]:
    """The shared storage URL and the ``sbatch`` binary, or one UserError — checked without opening the storage
    or writing anything (the submission's first step)."""
    if not storage:
        raise UserError(source="--storage", key="", why=f"a shared storage is required (or ${STORAGE_VAR}): "
                        "postgresql+psycopg://USER@HOST/DB or journal:///shared/file.log")
    if not allows_parallel_workers(storage):
        raise UserError(source="--storage", key=redact(storage), why="SQLite is single-process and not safe on "
                        "shared filesystems: SLURM workers need postgresql+psycopg://... or journal:///...")
    check_storage_url(storage, parallel=True)
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UserError(source="dsopt slurm submit", key="sbatch", why="not found on PATH: is this a SLURM login "
                        "node? (--dry-run prints the script)")
    return storage, sbatch


def submit(*, spec: StudySpec, workers: int, storage: str | None, dry_run: bool) -> Submission:
    """Write and submit the array (or only build the script when ``dry_run``); the model is traced first when
    the study asks (after the storage and ``sbatch`` are checked)."""
    python = spec.slurm.python or sys.executable
    script = sbatch_script(spec=spec, workers=workers, python=python, workdir=REPO_ROOT,
                           log_dir=slurm_dir(spec))
    if dry_run:
        return Submission(script=script, script_path=None, job_id=None)
    url, sbatch = check_submission(storage)
    storages.open_storage(url, workers=spec.workers).get_all_studies()  # unreachable storage: fail here, not in N jobs
    from launchers.trace.study_traces import with_traced_activations

    with_traced_activations(spec)  # once here, so the array's workers find the cache folder warm (cache_dir())
    folder = slurm_dir(spec)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "worker.sbatch"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(script)
    tmp.replace(path)
    env = dict(os.environ)
    env[STORAGE_VAR] = url
    done = subprocess.run([sbatch, "--parsable", str(path)], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        complaint = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        raise UserError(source="sbatch", key=str(path), why=redact(complaint))
    job_id = done.stdout.strip().split(";")[0]
    jobs_path = folder / "jobs.json"
    jobs = json.loads(jobs_path.read_text()) if jobs_path.exists() else []
    jobs.append({"job_id": job_id, "workers": workers, "submitted": now_utc().isoformat(), "storage": redact(url)})
    tmp = jobs_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(jobs, indent=2) + "\n")
    tmp.replace(jobs_path)
    return Submission(script=script, script_path=path, job_id=job_id)


def worker_table(study: optuna.Study) -> str:
    """Trials per worker and state: measured / reused / pruned / failed / running."""
    rows: dict[str, Counter] = {}
    for t in study.get_trials(deepcopy=False):
        worker = str(t.user_attrs.get(WORKER_ATTR, "(none)"))
        if t.state is optuna.trial.TrialState.COMPLETE:
            kind = "reused" if "reused_from" in t.user_attrs else "measured"
        elif t.state is optuna.trial.TrialState.WAITING:
            kind = "waiting"
            worker = "(queue)"
        else:
            kind = t.state.name.lower().replace("fail", "failed")
        rows.setdefault(worker, Counter())[kind] += 1
    kinds = ("measured", "reused", "pruned", "failed", "running", "waiting")
    width = max([len("worker"), *map(len, rows)])
    lines = [f"{'worker':<{width}}  " + "  ".join(f"{k:>8}" for k in kinds)]
    for worker in sorted(rows):
        lines.append(f"{worker:<{width}}  " + "  ".join(f"{rows[worker][k]:>8}" for k in kinds))
    total = sum(rows.values(), Counter())
    lines.append(f"{'total':<{width}}  " + "  ".join(f"{total[k]:>8}" for k in kinds))
    return "\n".join(lines)


def job_lines(spec: StudySpec) -> list[str]:
    """The recorded array jobs as ``squeue`` and ``sacct`` see them (each tool where available)."""
    jobs_path = slurm_dir(spec) / "jobs.json"
    if not jobs_path.exists():
        return ["no SLURM jobs recorded for this study (dsopt slurm submit writes studies/NAME/slurm/jobs.json)"]
    lines = []
    for job in json.loads(jobs_path.read_text()):
        lines.append(f"job {job['job_id']}: {job['workers']} worker(s), submitted {job['submitted']}")
        for tool, argv in (("squeue", ["squeue", "-h", "-r", "-j", job["job_id"], "-o", "%i %T %M %R"]),
                           ("sacct", ["sacct", "-n", "-P", "-X", "-j", job["job_id"],
                                      "-o", "JobID,State,Elapsed,ExitCode"])):
            if shutil.which(tool) is None:
                lines.append(f"  {tool}: not available here")
                continue
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            out = done.stdout.strip()
            if done.returncode != 0:
                first = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]
                lines.append(f"  {tool}: unavailable ({first})")
            elif out:
                lines.extend(f"  {tool}: {line.replace('|', ' ')}" for line in out.splitlines())
            else:
                lines.append(f"  {tool}: no such job now" if tool == "squeue" else f"  {tool}: no record")
    return lines


def load_for_status(spec: StudySpec, storage: str) -> optuna.Study:
    """The shared study for ``dsopt slurm status``; UserError if it is not there (yet). Reading never creates a
    journal file, an SQLite file or Optuna's tables (:func:`optimizer.search.storage.check_readable`)."""
    check_readable(storage)  # opening with Optuna would create the file or the tables; the first worker does
    try:
        return optuna.load_study(study_name=spec.name, storage=storages.open_storage(storage, workers=spec.workers))
    except KeyError:
        raise UserError(source="--storage", key=redact(storage), why=f"no study named {spec.name!r} in it yet "
                        "(the first worker creates it)") from None
    except UserError:
        raise
    except Exception as err:
        raise storage_error(storage, err) from None
