"""The ``dsopt`` command line. Thin: parse, load the study, one library call, print.

``main()`` returns the exit code: 0 on success, 2 on a user mistake (printed on one line); ``dsopt trial``
returns 1 when the trial ran and failed (its outcome — oom, oom_host, nan, unsupported, timeout, crash —
is printed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NoReturn

from optimizer import cli_results
from optimizer.errors import EXIT_USER_ERROR, UserError
from optimizer.knobs import KNOB_NAMES, Candidate, parse_knob
from optimizer.ledger import evaluate
from optimizer.ledger_report import all_json, all_table, ledger_json, ledger_table, throughput_lines
from optimizer.specs import SeedModel, TransformerModel, baseline_candidate
from optimizer.storage import check_shared_storage, redact
from optimizer.study_file import StudySpec, load_study
from optimizer.throughput import StepTime, predict_candidate
from optimizer.transformer import parameter_count
from optimizer.trial_report import trial_json, trial_table
from optimizer.trial_result import Outcome
from optimizer.versions import warn_deepspeed_mismatch

if TYPE_CHECKING:
    from launchers.node_share import WorkerSlot


def _parse_sets(pairs: Sequence[str], *, base: Candidate) -> Candidate:
    """``--set knob=value`` pairs applied to ``base``; each mistake names the knob."""
    overrides: dict[str, object] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise UserError(source="--set", key=pair, why="expected knob=value, e.g. zero_stage=2")
        if name in overrides:
            raise UserError(source="--set", key=name, why="given twice")
        try:
            overrides[name] = parse_knob(name, value)
        except KeyError:
            raise UserError(source="--set", key=name, why=f"unknown knob; knobs are {', '.join(KNOB_NAMES)}") from None
        except ValueError as err:
            raise UserError(source="--set", key=name, why=str(err)) from None
    return replace(base, **overrides)


def _psi(study: StudySpec) -> int:
    return study.model.parameters if isinstance(study.model, SeedModel) else parameter_count(study.model)


def _counted(study: StudySpec) -> StudySpec:
    """The study with its model's parameter inventory when its code builds it (torch is imported only then)."""
    if isinstance(study.model, TransformerModel) and study.model.counted_from_code:
        from launchers.inventory import with_inventory

        return with_inventory(study)
    return study


def _study(path: str) -> StudySpec:
    """The study file, with the parameter inventory of a ``transformers`` or entry-point model (built on fake
    tensors, cached; one warning and the shape's layout when it cannot be built) and its model traced when it
    says ``activations: trace`` or ``auto``, the default (cached; a failed trace warns on stderr and leaves the
    formula in place)."""
    study = load_study(path)
    study = _counted(study)
    if isinstance(study.model, TransformerModel) and study.model.wants_trace:
        from launchers.trace import with_traced_activations

        study = with_traced_activations(study)
    return study


def _invalid_candidate(study: StudySpec, candidate: Candidate, reasons: Sequence[str], *,
                       sets: Sequence[str]) -> UserError:
    """The one-line error for a candidate the study cannot run: blamed on ``--set`` when the user gave knobs,
    on the study file when the baseline the unset knobs fall back to is what the study rules out (e.g.
    ``training.model_init: zero_init`` needs stage 3, or fp32 is not in ``hardware.supported_precisions``)."""
    knobs = " ".join(f"{k}={v}" for k, v in candidate.knobs().items())
    if sets:
        return UserError(source="--set", key=knobs, why="invalid combination: " + "; ".join(reasons))
    return UserError(source=str(study.path), key="baseline", why=f"the default candidate ({knobs}) is invalid for "
                     f"this study: {'; '.join(reasons)}; choose one with --set KNOB=VALUE (e.g. --set zero_stage=3), "
                     "or list the valid ones with --all")


def _ledger(args: argparse.Namespace) -> int:
    warn_deepspeed_mismatch()  # the ledger is one DeepSpeed release's allocations (optimizer/versions.py)
    study = _study(args.study)
    base = baseline_candidate(study.training)
    if args.calibrated:
        return _ledger_calibrated(study, args)
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}
    if args.all:
        if args.set:
            raise UserError(source="--set", key="", why="--all evaluates the whole search space; drop --set")
        verdicts = [evaluate(candidate=c, **spec) for c in study.search_space.candidates(base)]
        speeds = {v.candidate.label(): _speed(study, v.candidate) for v in verdicts if v.ledger is not None}
        if args.json:
            out = all_json(verdicts, study=study.name)
            for entry in out["candidates"]:
                if "label" in entry and entry.get("valid", True):
                    entry["throughput"] = _speed_json(speeds.get(entry["label"]))
            print(json.dumps(out, indent=2))
        else:
            print(all_table(verdicts, study=study.name, speeds=speeds))
        return 0
    candidate = _parse_sets(args.set, base=base)
    verdict = evaluate(candidate=candidate, **spec)
    if verdict.ledger is None:
        raise _invalid_candidate(study, candidate, verdict.invalid_reasons, sets=args.set)
    speed = _speed(study, candidate)
    construction = study.training.construction(candidate.zero_stage)
    if args.json:
        out = ledger_json(verdict.ledger)
        out["study"] = study.name
        out["parameters"] = _psi(study)
        out["throughput"] = _speed_json(speed)
        out["construction"] = {"construction": str(construction), "model_init": str(study.training.model_init)}
        out["inventory"] = _inventory_json(study)
        print(json.dumps(out, indent=2))
    else:
        print(ledger_table(verdict.ledger, study=study.name, psi=_psi(study)))
        inventory = study.model.inventory if isinstance(study.model, TransformerModel) else None
        print("\n".join(["", *(inventory.summary_lines() if inventory else [
            "Parameters: from the shape's layout (a study given by its shape, or a model that could not be built "
            "on fake tensors)" if isinstance(study.model, TransformerModel) else "Parameters: as the study "
            "states them (seed mode)"])]))
        print(f"\nmodel construction priced in the init phase: {construction} "
              f"(training.model_init: {study.training.model_init})")
        print("\n".join(["", *throughput_lines(speed)]))
    return 0


def _ledger_calibrated(study: StudySpec, args: argparse.Namespace) -> int:
    from optimizer.calibration_report import calibration_table
    from optimizer.ordering import study_models

    if isinstance(study.model, SeedModel):
        raise UserError(source=str(study.path), key="model.kind", why="calibration needs measured trials of a "
                        "transformer-mode model")
    stored = cli_results.stored_study(study, args.storage)
    trials = stored.get_trials(deepcopy=False)
    models = study_models(spec=study, trials=trials, base=baseline_candidate(study.training))
    print(calibration_table(spec=study, trials=trials, models=models))
    return 0


def _inventory_json(study: StudySpec) -> dict[str, object] | None:
    """The parameter inventory's summary for ``--json`` (None: the shape's layout or seed mode)."""
    inventory = study.model.inventory if isinstance(study.model, TransformerModel) else None
    if inventory is None:
        return None
    name, largest = inventory.largest_module()
    return {"source": inventory.source, "model_class": inventory.model_class, "parameters": inventory.parameters,
            "tensors": len(inventory.tensors), "largest_module": {"name": name, "elements": largest},
            "by_module_type": [{"module_type": t, "tensors": n, "elements": e}
                               for t, n, e in inventory.by_module_type()],
            "tied": [list(group) for group in inventory.tied]}


def _speed(study: StudySpec, candidate: Candidate) -> StepTime | str:
    if isinstance(study.model, SeedModel):
        return "unknown: a seed-mode model has no shape to count work on"
    return predict_candidate(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)


def _speed_json(speed: StepTime | str | None) -> dict[str, object]:
    if not isinstance(speed, StepTime):
        return {"known": False, "reason": speed or "not evaluated"}
    return {"known": True, "tokens_per_s": speed.tokens_per_s, "step_s": speed.total_s,
            "terms_s": dict(speed.terms_s), "source": speed.source}


def _trial(args: argparse.Namespace) -> int:
    from launchers.trial import (
        ReferenceFailed,
        check_devices,
        reference_candidate,
        reference_losses,
        run_trial,
        trial_dir_for,
    )

    study = _study(args.study)
    candidate = _parse_sets(args.set, base=baseline_candidate(study.training))
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}
    verdict = evaluate(candidate=candidate, **spec)
    if verdict.ledger is None:
        raise _invalid_candidate(study, candidate, verdict.invalid_reasons, sets=args.set)
    if isinstance(study.model, SeedModel):
        raise UserError(source=str(study.path), key="model.kind", why="a seed-mode model has no shape to run; "
                        "trials need model.kind: transformer")
    gpus = check_devices(study)
    reference = None
    own_reference = candidate == reference_candidate(study)
    if not own_reference:
        try:
            reference = reference_losses(study, gpus=gpus)
        except ReferenceFailed as failed:
            print(f"dsopt: warning: {failed}; loss fidelity is not computed", file=sys.stderr)
    result = run_trial(study=study, candidate=candidate, reference_losses=reference, gpus=gpus)
    if own_reference and result.losses:
        result = replace(result, loss_fidelity=0.0)  # the FP32 reference itself
    data = trial_json(result=result, ledger=verdict.ledger, tolerance=study.trial.tolerance(candidate.precision),
                      trial_dir=str(trial_dir_for(study, candidate)), study=study.name)
    print(json.dumps(data, indent=2) if args.json else trial_table(data))
    return 0 if result.outcome is Outcome.OK else 1


def _runnable_study(path: str, *, slot: WorkerSlot | None = None) -> tuple[StudySpec, tuple[str, ...] | None]:
    """The study file and this worker's GPU slice (None: CPU ranks or whole nodes), refused (exit 2) if it
    cannot run trials here."""
    from launchers.trial import check_devices

    study = _counted(load_study(path))  # traced by run_study, once the storage is open
    if isinstance(study.model, SeedModel):
        raise UserError(source=str(study.path), key="model.kind", why="a seed-mode model has no shape to run; "
                        "studies need model.kind: transformer")
    return study, check_devices(study, slot=slot)


def _run(study: StudySpec, storage: str, args: argparse.Namespace, *, parallel: bool,
         gpus: tuple[str, ...] | None) -> int:
    """``dsopt study run`` and ``dsopt worker``: run, then one summary line."""
    from launchers.progress import ProgressMode
    from launchers.study_run import counts, run_study
    from launchers.trial import ReferenceFailed

    mode = ProgressMode.JSONL if args.jsonl else ProgressMode.QUIET if args.quiet else ProgressMode.HUMAN
    try:
        result = run_study(spec=study, storage=storage, n_trials=args.n_trials, timeout_s=args.timeout,
                           parallel=parallel, gpus=gpus, progress=mode)
    except ReferenceFailed as failed:
        print(f"dsopt: {failed}; see {study.output_dir / 'reference' / 'log.txt'}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dsopt: interrupted; the running trial is recorded as failed — run the same command to continue",
              file=sys.stderr)
        return 130
    c = counts(result)
    who = " (all workers)" if parallel else ""
    summary = sys.stderr if mode is ProgressMode.JSONL else sys.stdout  # stdout: the records only
    print(f"study {study.name}{who}: {c['measured']} measured, {c['reused']} reused, {c['pruned']} pruned by the "
          f"ledger, {c['held']} held by the launch margin, {c['failed']} failed, {c['running']} running; feasible "
          f"Pareto front: {len(result.best_trials)} trial(s)", file=summary)
    print(f"storage: {redact(storage)}", file=summary)
    return 0


def _progress_flags(parser: argparse.ArgumentParser) -> None:
    """``--quiet`` / ``--jsonl``: what a running study prints (launchers/progress.py)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quiet", action="store_true", help="no line per trial: only when the worker waits or "
                       "stops, errors, and the summary")
    group.add_argument("--jsonl", action="store_true", help="one JSON object per finished trial on stdout (for "
                       "scripts); everything else on stderr")


def _study_run(args: argparse.Namespace) -> int:
    from launchers.study_run import default_storage

    study, gpus = _runnable_study(args.study)
    return _run(study, args.storage or default_storage(study), args, parallel=False, gpus=gpus)


def _shared_storage(args: argparse.Namespace) -> str:
    from launchers.slurm import STORAGE_VAR

    storage = args.storage or os.environ.get(STORAGE_VAR)
    if not storage:
        raise UserError(source="--storage", key="", why=f"workers share a storage: give --storage URL or set "
                        f"${STORAGE_VAR} (postgresql+psycopg://USER@HOST/DB or journal:///shared/file.log)")
    return storage


def _worker(args: argparse.Namespace) -> int:
    storage = _shared_storage(args)
    check_shared_storage(storage)  # before the model is counted and traced
    study, gpus = _runnable_study(args.study, slot=args.slot)
    return _run(study, storage, args, parallel=True, gpus=gpus)


def _slurm_submit(args: argparse.Namespace) -> int:
    from launchers.slurm import STORAGE_VAR, submit

    # traced by submit() once the storage is checked, so the array's workers find studies/NAME/traces.json warm
    study = load_study(args.study) if args.dry_run else _counted(load_study(args.study))
    if isinstance(study.model, SeedModel):
        raise UserError(source=str(study.path), key="model.kind", why="a seed-mode model has no shape to run; "
                        "studies need model.kind: transformer")
    storage = args.storage or os.environ.get(STORAGE_VAR)
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
    from launchers.slurm import job_lines, load_for_status, worker_table

    study = load_study(args.study)
    storage = _shared_storage(args)
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


def _trace(args: argparse.Namespace) -> int:
    from launchers.trace import trace_rows

    study = load_study(args.study)
    if isinstance(study.model, SeedModel):
        raise UserError(source=str(study.path), key="model.kind", why="a seed-mode model has no shape to trace")
    study = _counted(study)
    rows = trace_rows(study=study, cache=study.output_dir / "traces.json")
    if args.json:
        print(json.dumps({"study": study.name, "inventory": _inventory_json(study), "rows": rows}, indent=2))
        return 0
    if study.model.inventory is not None:
        print("\n".join([*study.model.inventory.summary_lines(), ""]))
    print(f"study {study.name}: one micro-batch ({study.training.micro_batch_size} x "
          f"{study.training.sequence_length} tokens) forward + backward on fake tensors; MB = 10^6 bytes")
    print("peak: high-water mark of activations + temporaries (traced) vs Korthikanti's stored + one recomputed "
          "block (formula); kept: live when forward ends, in the blocks / outside them (embeddings, head, loss)")
    print("| checkpointing | precision | peak traced MB (phase) | formula MB | difference | "
          "kept in blocks traced / formula MB | kept outside traced / formula MB | parameters traced / ledger |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        if row["source"] != "trace":
            failure = row["failure"]
            print(f"| {row['checkpointing']} | {row['precision']} | - | {row['formula_bytes'] / 1e6:.3f} | - | "
                  f"- | - | warning: trace failed at {failure['op']} ({failure['message'][:80]}); "
                  "the formula is used |")
            continue
        diff = (row["activation_peak_bytes"] - row["formula_bytes"]) / row["formula_bytes"]
        print(f"| {row['checkpointing']} | {row['precision']} | {row['activation_peak_bytes'] / 1e6:.3f} "
              f"({row['peak_phase']}) | {row['formula_bytes'] / 1e6:.3f} | {diff:+.1%} | "
              f"{row['blocks_stored_bytes'] / 1e6:.3f} / "
              f"{row['formula_blocks_stored_bytes'] / 1e6:.3f} | {row['outside_blocks_bytes'] / 1e6:.3f} / "
              f"{row['formula_outside_blocks_bytes'] / 1e6:.3f} | {row['parameters']:,} / "
              f"{row['formula_parameters']:,} |")
    traced = [row for row in rows if row["source"] == "trace"]
    if traced:
        print("\nkept when forward ends, by the op that made each tensor (MB; aten.clone: contiguous copies, "
              "aten.empty_like: CPU dropout masks in the input's dtype):")
    for row in traced:
        ops = ", ".join(f"{op} {size / 1e6:.3f}" for op, size in list(row["kept_by_op"].items())[:8])
        print(f"  {row['checkpointing']} {row['precision']}: {ops}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from launchers.demo import DEMO_STUDY, run_demo
    from launchers.trial import ReferenceFailed
    from optimizer.pareto import front_table

    study = _study(args.study or DEMO_STUDY)
    print(f"dsopt demo: {study.path}, {study.hardware.gpus_per_node} {study.hardware.accelerator} ranks, until "
          f"{args.n_trials} trials have finished", file=sys.stderr)
    try:
        demo = run_demo(spec=study, n_trials=args.n_trials)
    except ReferenceFailed as failed:
        print(f"dsopt: {failed}; see {study.output_dir / 'reference' / 'log.txt'}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dsopt: interrupted; run the demo again to continue", file=sys.stderr)
        return 130
    c, trial = demo.counts, demo.picked
    print(front_table(demo.study, budget_bytes=study.hardware.gpu_memory_bytes))
    print(f"\ntrials: {c['measured']} launched and measured, {c['reused']} reused, {c['pruned']} pruned by the "
          f"ledger (never launched), {c['held']} held by the launch margin, {c['failed']} failed (oom included); wall "
          f"time {demo.wall_s:.0f} s")
    print(f"picked (balanced): trial #{trial.number} {trial.user_attrs['candidate']}: {trial.values[0] / 1e6:.3f} MB "
          f"per rank, {trial.values[1]:,.0f} tokens/s, loss fidelity {trial.user_attrs.get('loss_fidelity', 0):.1e}")
    print(f"DeepSpeed config: {demo.config_path}\nPareto plots: {demo.png_path}, {demo.html_path}")
    return 0


def _slot(text: str) -> WorkerSlot:
    from launchers.node_share import parse_slot

    try:
        return parse_slot(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse with a usage mistake as one line (what is wrong, and where the help is), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dsopt", description="Search-based optimizer for DeepSpeed configurations.")
    sub = parser.add_subparsers(dest="command", required=True)
    ledger = sub.add_parser("ledger", help="itemised per-GPU / host / NVMe memory and the fits verdict")
    ledger.add_argument("study", help="study file, e.g. studies/seed-1b-2x24gb.yaml")
    ledger.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                        help=f"set a knob (repeatable); knobs: {', '.join(KNOB_NAMES)}; others take the baseline")
    ledger.add_argument("--all", action="store_true", help="every candidate of the study's search space, sorted")
    ledger.add_argument("--json", action="store_true", help="print JSON (integer bytes)")
    ledger.add_argument("--calibrated", action="store_true", help="predicted vs measured per trial of the stored "
                        "study, before and after the study's calibration")
    ledger.add_argument("--storage", default=None, help="with --calibrated: the study's storage URL "
                        "(default: its sqlite file)")
    ledger.set_defaults(run=_ledger)
    trial = sub.add_parser("trial", help="run one candidate for real: peak memory, speed, loss, fidelity")
    trial.add_argument("study", help="study file with a transformer-mode model, e.g. studies/cpu-tiny.yaml")
    trial.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                       help="set a knob (repeatable); others take the baseline")
    trial.add_argument("--json", action="store_true", help="print one JSON object")
    trial.set_defaults(run=_trial)
    study = sub.add_parser("study", help="Optuna studies")
    study_sub = study.add_subparsers(dest="study_command", required=True)
    study_run = study_sub.add_parser("run", help="create or resume a study and run trials")
    study_run.add_argument("study", help="study file")
    study_run.add_argument("--n-trials", type=_positive_int, default=None, help="trials to run in this invocation")
    study_run.add_argument("--timeout", type=_positive_seconds, default=None,
                           help="stop starting trials after S seconds")
    study_run.add_argument("--storage", default=None,
                           help="Optuna storage URL (default: sqlite file under studies/NAME/)")
    study_run.set_defaults(run=_study_run)
    _progress_flags(study_run)
    worker = sub.add_parser("worker", help="join a study on a shared storage and run trials until its budget "
                            "is spent")
    worker.add_argument("study", help="study file")
    worker.add_argument("--storage", default=None, help="shared Optuna storage URL (default: $DSOPT_STORAGE); "
                        "postgresql+psycopg://... or journal:///shared/file.log")
    worker.add_argument("--n-trials", type=_positive_int, default=None, help="at most N trials in this worker")
    worker.add_argument("--timeout", type=_positive_seconds, default=None, help="stop starting trials after S seconds")
    worker.add_argument("--slot", type=_slot, default=None, metavar="K[/N]", help="this worker's share of the "
                        "node's GPUs when several workers share it: GPUs K*g..K*g+g-1 of those visible (g = "
                        "hardware.gpus_per_node), K from 0; K/N also checks that N workers fit (default: "
                        "$SLURM_LOCALID inside an srun step, else 0)")
    _progress_flags(worker)
    worker.set_defaults(run=_worker)
    slurm = sub.add_parser("slurm", help="run the study's workers as a SLURM job array")
    slurm_sub = slurm.add_subparsers(dest="slurm_command", required=True)
    slurm_submit = slurm_sub.add_parser("submit", help="write the sbatch script and submit it")
    slurm_submit.add_argument("study", help="study file (its slurm section holds the sbatch options)")
    slurm_submit.add_argument("--workers", type=_positive_int, required=True, help="array tasks (one worker each)")
    slurm_submit.add_argument("--storage", default=None, help="shared storage URL (default: $DSOPT_STORAGE)")
    slurm_submit.add_argument("--dry-run", action="store_true", help="print the script; submit nothing")
    slurm_submit.set_defaults(run=_slurm_submit)
    slurm_status = slurm_sub.add_parser("status", help="trials per worker and the array's jobs")
    slurm_status.add_argument("study", help="study file")
    slurm_status.add_argument("--storage", default=None, help="shared storage URL (default: $DSOPT_STORAGE)")
    slurm_status.set_defaults(run=_slurm_status)
    export = sub.add_parser("export", help="write a measured trial's DeepSpeed JSON")
    export.add_argument("study", help="study file")
    export.add_argument("--storage", default=None, help="Optuna storage URL (default: the study's sqlite file)")
    export.add_argument("--pick", default="balanced", help="fastest | smallest | balanced | trial=N")
    export.add_argument("--out", default=None, help="output path (default: studies/NAME/ds_config.PICK.json)")
    export.add_argument("--force", action="store_true", help="overwrite an existing file")
    export.add_argument("--hf", action="store_true", help="Hugging Face Trainer variant (batch sizes = auto)")
    export.set_defaults(run=cli_results.export)
    pareto = sub.add_parser("pareto", help="print the Pareto front and write pareto.png / pareto.html")
    pareto.add_argument("study", help="study file")
    pareto.add_argument("--storage", default=None, help="Optuna storage URL (default: the study's sqlite file)")
    pareto.add_argument("--out", default=None, help="output folder (default: studies/NAME/)")
    pareto.set_defaults(run=cli_results.pareto)
    dashboard = sub.add_parser("dashboard", help="optuna-dashboard on the study's storage, with each trial's "
                               "DeepSpeed JSON, result and log tail (pip install 'dsopt[dashboard]')")
    dashboard.add_argument("study", help="study file")
    dashboard.add_argument("--storage", default=None, help="Optuna storage URL (default: the study's sqlite file)")
    dashboard.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    dashboard.add_argument("--port", type=_positive_int, default=8080, help="port (default 8080)")
    dashboard.set_defaults(run=cli_results.dashboard)
    trace = sub.add_parser("trace", help="activations of the study's own model on fake tensors, beside the formula")
    trace.add_argument("study", help="study file with a transformer-mode model")
    trace.add_argument("--json", action="store_true", help="print JSON (integer bytes)")
    trace.set_defaults(run=_trace)
    demo = sub.add_parser("demo", help="a small real study on 2 CPU ranks, then export and Pareto plots")
    demo.add_argument("--study", default=None, help="study file (default: studies/demo-cpu.yaml)")
    demo.add_argument("--n-trials", type=_positive_int, default=16, help="finished trials to reach (default 16)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except UserError as err:
        print(f"dsopt: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # `dsopt ledger --json | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return 0


if __name__ == "__main__":
    sys.exit(main())
