"""The ``dsopt`` command line. Thin: parse, load the study, one library call, print.

``main()`` returns the exit code: 0 on success, 2 on a user mistake (printed on one line); ``dsopt trial``
returns 1 when the trial ran and failed (its outcome — oom, nan, unsupported, timeout, crash — is printed).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace

from optimizer.errors import EXIT_USER_ERROR, UserError
from optimizer.knobs import KNOB_NAMES, Candidate, parse_knob
from optimizer.ledger import evaluate
from optimizer.ledger_report import all_json, all_table, ledger_json, ledger_table
from optimizer.search import redact
from optimizer.specs import SeedModel, baseline_candidate
from optimizer.study_file import StudySpec, load_study
from optimizer.transformer import parameter_count
from optimizer.trial_report import trial_json, trial_table
from optimizer.trial_result import Outcome


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


def _ledger(args: argparse.Namespace) -> int:
    study = load_study(args.study)
    base = baseline_candidate(study.training)
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}
    if args.all:
        if args.set:
            raise UserError(source="--set", key="", why="--all evaluates the whole search space; drop --set")
        verdicts = [evaluate(candidate=c, **spec) for c in study.search_space.candidates(base)]
        if args.json:
            print(json.dumps(all_json(verdicts, study=study.name), indent=2))
        else:
            print(all_table(verdicts, study=study.name))
        return 0
    candidate = _parse_sets(args.set, base=base)
    verdict = evaluate(candidate=candidate, **spec)
    if verdict.ledger is None:
        knobs = " ".join(f"{k}={v}" for k, v in candidate.knobs().items())
        raise UserError(source="--set", key=knobs, why="invalid combination: " + "; ".join(verdict.invalid_reasons))
    if args.json:
        out = ledger_json(verdict.ledger)
        out["study"] = study.name
        out["parameters"] = _psi(study)
        print(json.dumps(out, indent=2))
    else:
        print(ledger_table(verdict.ledger, study=study.name, psi=_psi(study)))
    return 0


def _trial(args: argparse.Namespace) -> int:
    from launchers.trial import ReferenceFailed, check_devices, reference_losses, run_trial, trial_dir_for

    study = load_study(args.study)
    candidate = _parse_sets(args.set, base=baseline_candidate(study.training))
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}
    verdict = evaluate(candidate=candidate, **spec)
    if verdict.ledger is None:
        knobs = " ".join(f"{k}={v}" for k, v in candidate.knobs().items())
        raise UserError(source="--set", key=knobs, why="invalid combination: " + "; ".join(verdict.invalid_reasons))
    if isinstance(study.model, SeedModel):
        raise UserError(source=str(study.path), key="model.kind", why="a seed-mode model has no shape to run; "
                        "trials need model.kind: transformer")
    check_devices(study)
    reference = None
    if candidate != baseline_candidate(study.training):
        try:
            reference = reference_losses(study)
        except ReferenceFailed as failed:
            print(f"dsopt: warning: {failed}; loss fidelity is not computed", file=sys.stderr)
    result = run_trial(study=study, candidate=candidate, reference_losses=reference)
    if reference is None and result.losses and candidate == baseline_candidate(study.training):
        result = replace(result, loss_fidelity=0.0)  # the baseline is its own reference
    data = trial_json(result=result, ledger=verdict.ledger, tolerance=study.trial.tolerance(candidate.precision),
                      trial_dir=str(trial_dir_for(study, candidate)), study=study.name)
    print(json.dumps(data, indent=2) if args.json else trial_table(data))
    return 0 if result.outcome is Outcome.OK else 1


def _study_run(args: argparse.Namespace) -> int:
    from launchers.study_run import counts, default_storage, run_study
    from launchers.trial import check_devices

    study = load_study(args.study)
    if isinstance(study.model, SeedModel):
        raise UserError(source=str(study.path), key="model.kind", why="a seed-mode model has no shape to run; "
                        "studies need model.kind: transformer")
    check_devices(study)
    storage = args.storage or default_storage(study)
    try:
        result = run_study(spec=study, storage=storage, n_trials=args.n_trials, timeout_s=args.timeout)
    except KeyboardInterrupt:
        print("dsopt: interrupted; the running trial is recorded as failed — run the same command to continue",
              file=sys.stderr)
        return 130
    c = counts(result)
    print(f"study {study.name}: {c['measured']} measured, {c['reused']} reused, {c['pruned']} pruned by the "
          f"ledger, {c['failed']} failed; feasible Pareto front: {len(result.best_trials)} trial(s)")
    print(f"storage: {redact(storage)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsopt", description="Search-based optimizer for DeepSpeed configurations.")
    sub = parser.add_subparsers(dest="command", required=True)
    ledger = sub.add_parser("ledger", help="itemised per-GPU / host / NVMe memory and the fits verdict")
    ledger.add_argument("study", help="study file, e.g. studies/seed-1b-2x24gb.yaml")
    ledger.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                        help=f"set a knob (repeatable); knobs: {', '.join(KNOB_NAMES)}; others take the baseline")
    ledger.add_argument("--all", action="store_true", help="every candidate of the study's search space, sorted")
    ledger.add_argument("--json", action="store_true", help="print JSON (integer bytes)")
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
    study_run.add_argument("--n-trials", type=int, default=None, help="trials to run in this invocation")
    study_run.add_argument("--timeout", type=float, default=None, help="stop starting trials after S seconds")
    study_run.add_argument("--storage", default=None,
                           help="Optuna storage URL (default: sqlite file under studies/NAME/)")
    study_run.set_defaults(run=_study_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except UserError as err:
        print(f"dsopt: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
