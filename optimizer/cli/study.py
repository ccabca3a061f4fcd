"""``dsopt study run STUDY`` (one process) and ``dsopt worker STUDY`` (one of many on a shared storage)."""

from __future__ import annotations

import argparse
import sys

from optimizer.cli.common import positive_int, positive_seconds, progress_flags, runnable_study, shared_storage, slot
from optimizer.search.storage import check_storage_url, redact
from optimizer.study.study_file import StudySpec


def _run(study: StudySpec, storage: str, args: argparse.Namespace, *, parallel: bool,
         gpus: tuple[str, ...] | None) -> int:
    """``dsopt study run`` and ``dsopt worker``: run, then one summary line."""
    from launchers.study.progress import ProgressMode
    from launchers.study.study_run import run_study
    from launchers.trial.run import ReferenceFailed
    from optimizer.search.progress import counts

    mode = ProgressMode.JSONL if args.jsonl else ProgressMode.QUIET if args.quiet else ProgressMode.HUMAN
    try:
        result = run_study(spec=study, storage=storage, n_trials=args.n_trials, timeout_s=args.timeout,
                           parallel=parallel, gpus=gpus, progress=mode)
    except ReferenceFailed as failed:
        print(f"dsopt: {failed}; see {study.output_dir / 'reference' / 'log.txt'}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM/SIGHUP under `dsopt` (launchers.process.termination)
        from launchers.process.termination import exit_status, interrupt_name

        print(f"dsopt: {interrupt_name(interrupt)}; the running trial is recorded as failed — run the same command "
              "to continue", file=sys.stderr)
        return exit_status(interrupt)
    c = counts(result)
    who = " (all workers)" if parallel else ""
    summary = sys.stderr if mode is ProgressMode.JSONL else sys.stdout  # stdout: the records only
    print(f"study {study.name}{who}: {c['measured']} measured, {c['reused']} reused, {c['pruned']} pruned by the "
          f"ledger, {c['held']} held (risky proposals of the sampler), {c['failed']} failed, {c['running']} running; "
          f"feasible Pareto front: {len(result.best_trials)} trial(s)", file=summary)
    print(f"storage: {redact(storage)}", file=summary)
    return 0

def _study_run(args: argparse.Namespace) -> int:
    from launchers.study.study_run import default_storage

    if args.storage:
        check_storage_url(args.storage)  # every input is checked before the model is counted or a file written
    study, gpus = runnable_study(args.study)
    return _run(study, args.storage or default_storage(study), args, parallel=False, gpus=gpus)

def _worker(args: argparse.Namespace) -> int:
    storage = shared_storage(args)
    check_storage_url(storage, parallel=True)  # before the model is counted and traced
    study, gpus = runnable_study(args.study, slot=args.slot)
    return _run(study, storage, args, parallel=True, gpus=gpus)


def register(sub: argparse._SubParsersAction) -> None:
    study = sub.add_parser("study", help="Optuna studies")
    study_sub = study.add_subparsers(dest="study_command", required=True)
    study_run = study_sub.add_parser("run", help="create or resume a study and run trials")
    study_run.add_argument("study", help="study file")
    study_run.add_argument("--n-trials", type=positive_int, default=None, help="real DeepSpeed launches in this "
                           "invocation (retries and the FP32 reference included; pruned, held and reused "
                           "proposals launch nothing and are not counted)")
    study_run.add_argument("--timeout", type=positive_seconds, default=None,
                           help="stop starting trials after S seconds")
    study_run.add_argument("--storage", default=None,
                           help="Optuna storage URL (default: sqlite file under studies/NAME/)")
    study_run.set_defaults(run=_study_run)
    progress_flags(study_run)
    worker = sub.add_parser("worker", help="join a study on a shared storage and run trials until its budget "
                            "is spent")
    worker.add_argument("study", help="study file")
    worker.add_argument("--storage", default=None, help="shared Optuna storage URL (default: $DSOPT_STORAGE); "
                        "postgresql+psycopg://... or journal:///shared/file.log")
    worker.add_argument("--n-trials", type=positive_int, default=None, help="at most N real launches by this "
                        "worker (retries and the FP32 reference included)")
    worker.add_argument("--timeout", type=positive_seconds, default=None, help="stop starting trials after S seconds")
    worker.add_argument("--slot", type=slot, default=None, metavar="K[/N]", help="this worker's share of the "
                        "node's GPUs when several workers share it: GPUs K*g..K*g+g-1 of those visible (g = "
                        "hardware.gpus_per_node), K from 0; K/N also checks that N workers fit (default: "
                        "$SLURM_LOCALID inside an srun step, else 0)")
    progress_flags(worker)
    worker.set_defaults(run=_worker)
