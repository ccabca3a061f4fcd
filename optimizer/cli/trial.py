"""``dsopt trial STUDY --set KNOB=VALUE``: one candidate run for real, beside the ledger's prediction."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from optimizer.cli.common import checked_candidate, invalid_candidate, prepared_study, runnable_model
from optimizer.ledger.core import evaluate
from optimizer.results.trial_report import trial_json, trial_table
from optimizer.results.trial_result import Outcome
from optimizer.study.study_file import load_study

if TYPE_CHECKING:
    from launchers.trial.reference_batches import Judge


def run(args: argparse.Namespace) -> int:
    from launchers.trial.reference_batches import judge_for, kept_as_reference
    from launchers.trial.run import check_devices, run_trial, trial_dir_for

    study = load_study(args.study)  # every input checked before the model is counted, traced or run
    runnable_model(study, what="run")
    candidate = checked_candidate(study, args.set)
    gpus = check_devices(study)
    # the whole space (the FP32 reference is the fastest FP32 variant that fits) and the candidate, in it or not
    study = prepared_study(study, also=[candidate])
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}
    verdict = evaluate(candidate=candidate, **spec)
    if verdict.ledger is None:  # checked above; the inventory cannot make a valid candidate invalid
        raise invalid_candidate(study, candidate, verdict.invalid_reasons, sets=args.set)
    # judged against the FP32 reference at its own micro-batch where dropout draws masks per micro-batch; the
    # reference's own candidate, not cached yet, is the reference: its run is kept as it
    judge = judge_for(study, candidate, study_reference_held=False)
    reference = None if judge.own else _reference(judge, gpus)
    again = judge_for(study, candidate, study_reference_held=False)  # the reference may have measured draws the
    if again.name != judge.name:  # study does not say (launchers/measure/rng_draws.py): its micro-batch's judges
        judge, reference = again, None if again.own else _reference(again, gpus)
    result = kept_as_reference(judge, candidate, run_trial(study=study, candidate=candidate,
                                                           reference_losses=reference, gpus=gpus))
    data = trial_json(result=result, ledger=verdict.ledger, tolerance=study.trial.tolerance(candidate.precision),
                      trial_dir=str(trial_dir_for(study, candidate)), study=study.name)
    print(json.dumps(data, indent=2) if args.json else trial_table(data))
    return 0 if result.outcome is Outcome.OK else 1


def _reference(judge: Judge, gpus: Sequence[str] | None) -> list[float] | None:
    """The FP32 reference losses of ``judge`` (cached or launched now); None, said, where that run fails."""
    from launchers.trial.run import ReferenceFailed, reference_losses

    try:
        return reference_losses(judge.study, gpus=gpus, name=judge.name)
    except ReferenceFailed as failed:
        print(f"dsopt: warning: {failed}; loss fidelity is not computed", file=sys.stderr)
        return None


def register(sub: argparse._SubParsersAction) -> None:
    trial = sub.add_parser("trial", help="run one candidate for real: peak memory, speed, loss, fidelity")
    trial.add_argument("study", help="study file with a transformer-mode model, e.g. studies/cpu-tiny.yaml")
    trial.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                       help="set a knob (repeatable); others take the baseline")
    trial.add_argument("--json", action="store_true", help="print one JSON object")
    trial.set_defaults(run=run)
