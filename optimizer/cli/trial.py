"""``dsopt trial STUDY --set KNOB=VALUE``: one candidate run for real, beside the ledger's prediction."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from optimizer.cli.common import invalid_candidate, parse_sets, prepared_study
from optimizer.ledger.core import evaluate
from optimizer.results.trial_report import trial_json, trial_table
from optimizer.results.trial_result import Outcome
from optimizer.study.errors import UserError
from optimizer.study.specs import SeedModel, baseline_candidate


def run(args: argparse.Namespace) -> int:
    from launchers.trial import (
        ReferenceFailed,
        check_devices,
        reference_candidate,
        reference_losses,
        run_trial,
        trial_dir_for,
    )

    study = prepared_study(args.study)
    candidate = parse_sets(args.set, base=baseline_candidate(study.training))
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}
    verdict = evaluate(candidate=candidate, **spec)
    if verdict.ledger is None:
        raise invalid_candidate(study, candidate, verdict.invalid_reasons, sets=args.set)
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


def register(sub: argparse._SubParsersAction) -> None:
    trial = sub.add_parser("trial", help="run one candidate for real: peak memory, speed, loss, fidelity")
    trial.add_argument("study", help="study file with a transformer-mode model, e.g. studies/cpu-tiny.yaml")
    trial.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                       help="set a knob (repeatable); others take the baseline")
    trial.add_argument("--json", action="store_true", help="print one JSON object")
    trial.set_defaults(run=run)
