"""``dsopt ledger STUDY``: the itemised memory of one candidate or of the whole search space, and with
``--calibrated`` the stored trials' predicted vs measured."""

from __future__ import annotations

import argparse
import json

from optimizer.cli.common import (
    invalid_candidate,
    inventory_json,
    parse_sets,
    prepared_study,
    psi,
    speed,
    speed_json,
    stored_study,
)
from optimizer.deepspeed.versions import warn_deepspeed_mismatch
from optimizer.ledger.core import evaluate
from optimizer.ledger.report import all_json, all_table, ledger_json, ledger_table, throughput_lines
from optimizer.study.errors import UserError
from optimizer.study.knobs import KNOB_NAMES
from optimizer.study.specs import SeedModel, TransformerModel, baseline_candidate
from optimizer.study.study_file import StudySpec


def run(args: argparse.Namespace) -> int:
    warn_deepspeed_mismatch()  # the ledger is one DeepSpeed release's allocations (optimizer/deepspeed/versions.py)
    study = prepared_study(args.study)
    base = baseline_candidate(study.training)
    if args.calibrated:
        return _ledger_calibrated(study, args)
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}
    if args.all:
        if args.set:
            raise UserError(source="--set", key="", why="--all evaluates the whole search space; drop --set")
        verdicts = [evaluate(candidate=c, **spec) for c in study.search_space.candidates(base)]
        speeds = {v.candidate.label(): speed(study, v.candidate) for v in verdicts if v.ledger is not None}
        if args.json:
            out = all_json(verdicts, study=study.name)
            for entry in out["candidates"]:
                if "label" in entry and entry.get("valid", True):
                    entry["throughput"] = speed_json(speeds.get(entry["label"]))
            print(json.dumps(out, indent=2))
        else:
            print(all_table(verdicts, study=study.name, speeds=speeds))
        return 0
    candidate = parse_sets(args.set, base=base)
    verdict = evaluate(candidate=candidate, **spec)
    if verdict.ledger is None:
        raise invalid_candidate(study, candidate, verdict.invalid_reasons, sets=args.set)
    predicted = speed(study, candidate)
    construction = study.training.construction(candidate.zero_stage)
    if args.json:
        out = ledger_json(verdict.ledger)
        out["study"] = study.name
        out["parameters"] = psi(study)
        out["throughput"] = speed_json(predicted)
        out["construction"] = {"construction": str(construction), "model_init": str(study.training.model_init)}
        out["inventory"] = inventory_json(study)
        print(json.dumps(out, indent=2))
    else:
        print(ledger_table(verdict.ledger, study=study.name, psi=psi(study)))
        inventory = study.model.inventory if isinstance(study.model, TransformerModel) else None
        print("\n".join(["", *(inventory.summary_lines() if inventory else [
            "Parameters: from the shape's layout (a study given by its shape, or a model that could not be built "
            "on fake tensors)" if isinstance(study.model, TransformerModel) else "Parameters: as the study "
            "states them (seed mode)"])]))
        print(f"\nmodel construction priced in the init phase: {construction} "
              f"(training.model_init: {study.training.model_init})")
        print("\n".join(["", *throughput_lines(predicted)]))
    return 0

def _ledger_calibrated(study: StudySpec, args: argparse.Namespace) -> int:
    from optimizer.perf.calibration_report import calibration_table
    from optimizer.search.ordering import study_models

    if isinstance(study.model, SeedModel):
        raise UserError(source=str(study.path), key="model.kind", why="calibration needs measured trials of a "
                        "transformer-mode model")
    stored = stored_study(study, args.storage)
    trials = stored.get_trials(deepcopy=False)
    models = study_models(spec=study, trials=trials, base=baseline_candidate(study.training))
    print(calibration_table(spec=study, trials=trials, models=models))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
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
    ledger.set_defaults(run=run)
