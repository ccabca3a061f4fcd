"""``dsopt slurm submit`` and ``dsopt slurm status``: the study's workers as a SLURM job array."""

from __future__ import annotations

import argparse
import os

from optimizer.cli.common import counted, positive_int, runnable_model, shared_storage
from optimizer.search.storage import redact
from optimizer.study.study_file import load_study


def _slurm_submit(args: argparse.Namespace) -> int:
    from launchers.cluster.slurm import STORAGE_VAR, check_submission, submit
    from optimizer.search.space import branches

    study = load_study(args.study)
    runnable_model(study, what="run")
    branches(study)  # an empty search space: refused here, not in every array task
    storage = args.storage or os.environ.get(STORAGE_VAR)
    if not args.dry_run:
        check_submission(storage)  # the URL and sbatch, before the model is counted or the storage opened
        study = counted(study)  # traced by submit() once the storage answers, so the workers start warm
    done = submit(spec=study, workers=args.workers, storage=storage, dry_run=args.dry_run)
    if done.job_id is None:
        print(done.script, end="")
        return 0
    print(f"submitted job array {done.job_id}: {args.workers} worker(s) on study {study.name} "
          f"(storage {redact(storage or '')})")
    print(f"script: {done.script_path}; logs: {done.script_path.parent}/{done.job_id}_<task>.out")
    print(f"watch: dsopt slurm status {args.study} --storage '<URL>'   (or squeue -j {done.job_id})")
    return 0

def _slurm_status(args: argparse.Namespace) -> int:
    from launchers.cluster.slurm import job_lines, load_for_status, worker_table

    study = load_study(args.study)
    storage = shared_storage(args)
    stored = load_for_status(study, storage)
    best = stored.best_trials
    print(f"study {study.name} on {redact(storage)}")
    print(worker_table(stored))
    if best:
        fastest = max(best, key=lambda t: t.values[1])
        print(f"feasible Pareto front: {len(best)} trial(s); fastest #{fastest.number} {fastest.values[1]:,.0f} "
              f"tokens/s at {fastest.values[0] / 1e6:.2f} MB of training memory per device (10^6 bytes)")
    else:
        print("feasible Pareto front: empty so far")
    print("\n".join(job_lines(study)))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    slurm = sub.add_parser("slurm", help="run the study's workers as a SLURM job array")
    slurm_sub = slurm.add_subparsers(dest="slurm_command", required=True)
    slurm_submit = slurm_sub.add_parser("submit", help="write the sbatch script and submit it")
    slurm_submit.add_argument("study", help="study file (its slurm section holds the sbatch options)")
    slurm_submit.add_argument("--workers", type=positive_int, required=True, help="array tasks (one worker each)")
    slurm_submit.add_argument("--storage", default=None, help="shared storage URL (default: $DSOPT_STORAGE)")
    slurm_submit.add_argument("--dry-run", action="store_true", help="print the script; submit nothing")
    slurm_submit.set_defaults(run=_slurm_submit)
    slurm_status = slurm_sub.add_parser("status", help="trials per worker and the array's jobs")
    slurm_status.add_argument("study", help="study file")
    slurm_status.add_argument("--storage", default=None, help="shared storage URL (default: $DSOPT_STORAGE)")
    slurm_status.set_defaults(run=_slurm_status)
