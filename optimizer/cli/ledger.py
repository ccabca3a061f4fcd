"""``dsopt ledger STUDY``: the itemised memory of one candidate or of the whole search space, and with
``--calibrated`` the stored trials' predicted vs measured."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from optimizer.cli.common import (
    checked_candidate,
    invalid_candidate,
    inventory_json,
    prepared_study,
    psi,
    refuse_together,
    speed,
    speed_json,
    stored_study,
)
from optimizer.deepspeed.versions import warn_deepspeed_mismatch
from optimizer.ledger.core import Verdict, evaluate
from optimizer.perf.throughput import StepTime
from optimizer.results.plan import plan_json, plan_text
from optimizer.results.report import all_json, all_table, ledger_json, ledger_table, throughput_lines
from optimizer.study.errors import UserError
from optimizer.study.knobs import KNOB_NAMES, Candidate
from optimizer.study.specs import SeedModel, TransformerModel, baseline_candidate
from optimizer.study.study_file import StudySpec, load_study
from optimizer.study.units import format_bytes


def _check_flags(args: argparse.Namespace) -> None:
    """Flag combinations that mean nothing, refused before the study is read (exit 2)."""
    refuse_together(args, "--calibrated", "--set", "--all", "--invalid", why="--calibrated compares the stored "
                    "trials' predictions with their measurements; it takes no candidate or plan flags")
    refuse_together(args, "--calibrated", "--json", why="--calibrated prints a table only; without it --json "
                    "prints the ledger")
    refuse_together(args, "--all", "--set", why="--all evaluates the whole search space; drop --set")
    refuse_together(args, "--invalid", "--set", "--all", "--json", why="--invalid lists the invalid candidates "
                    "under the plan; --all and --json include them already, and one --set candidate has none")
    if args.storage and not args.calibrated:
        raise UserError(source="--storage", key=args.storage, why="only --calibrated reads a storage")


def run(args: argparse.Namespace) -> int:
    _check_flags(args)
    study = load_study(args.study)  # every input checked before the model is counted or traced
    if args.calibrated:
        return _ledger_calibrated(study, args)
    candidate = checked_candidate(study, args.set) if args.set else None
    warn_deepspeed_mismatch()  # the ledger is one DeepSpeed release's allocations (optimizer/deepspeed/versions.py)
    if candidate is not None:
        return _one(prepared_study(study, candidates=[candidate]), candidate, args)
    study = prepared_study(study)
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}
    base = baseline_candidate(study.training)
    verdicts = [evaluate(candidate=c, **spec) for c in study.search_space.candidates(base)]
    speeds = {v.candidate.label(): speed(study, v.candidate) for v in verdicts if v.ledger is not None}
    if args.json:
        print(json.dumps(_plan_json(study, verdicts, speeds, all_candidates=args.all), indent=2))
    elif args.all:
        print(all_table(verdicts, study=study.name, speeds=speeds, binary=study.hardware.binary_units))
    else:
        print(plan_text(verdicts, speeds=speeds, study=study.name, fmt=_formatter(study),
                        column_fmt=_formatter(study, other=False), show_invalid=args.invalid))
        if note := _defaults_line(study):
            print(note)
    return 0


def _defaults_line(study: StudySpec) -> str | None:
    """Which device-memory figures the study left to dsopt's CUDA defaults (docs/study-file.md), or None."""
    hw = study.hardware
    taken = []
    if not hw.device_reserve_stated and hw.device_reserve_bytes:
        taken.append(f"hardware.device_reserve {format_bytes(hw.device_reserve_bytes, binary=hw.binary_units)}")
    if not hw.allocator_overhead_stated and hw.allocator_overhead:
        taken.append(f"hardware.allocator_overhead {hw.allocator_overhead:g}")
    if not taken:
        return None
    return (f"defaults applied (not in the study file): {', '.join(taken)} — published figures for CUDA "
            "(docs/study-file.md); state this device's own to replace them")


def _formatter(study: StudySpec, *, other: bool = True) -> Callable[[int], str]:
    """Bytes in the unit family the study wrote ``hardware.gpu_memory`` in, the other in brackets (``other``;
    the plan's table leaves it out so that a row fits a terminal's width; its header line names both units)."""
    binary = study.hardware.binary_units
    return lambda num_bytes: format_bytes(num_bytes, binary=binary, other=other)


def _one(study: StudySpec, candidate: Candidate, args: argparse.Namespace) -> int:
    """One candidate's itemised ledger (``--set``)."""
    verdict = evaluate(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)
    if verdict.ledger is None:  # checked on the study as written; the inventory cannot make it invalid
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
        return 0
    print(ledger_table(verdict.ledger, study=study.name, psi=psi(study), binary=study.hardware.binary_units))
    if note := _defaults_line(study):
        print(note)
    inventory = study.model.inventory if isinstance(study.model, TransformerModel) else None
    print("\n".join(["", *(inventory.summary_lines() if inventory else [
        "Parameters: from the shape's layout (a study given by its shape, or a model that could not be built "
        "on fake tensors)" if isinstance(study.model, TransformerModel) else "Parameters: as the study "
        "states them (seed mode)"])]))
    print(f"\nmodel construction priced in the init phase: {construction} "
          f"(training.model_init: {study.training.model_init})")
    print("\n".join(["", *throughput_lines(predicted)]))
    return 0


def _plan_json(study: StudySpec, verdicts: list[Verdict], speeds: dict[str, StepTime | str], *,
               all_candidates: bool) -> dict[str, object]:
    """``--json``: the baseline's ledger as before (or why it is invalid) with the plan beside it; ``--all
    --json``: every candidate, as before."""
    if all_candidates:
        out = all_json(verdicts, study=study.name)
        for entry in out["candidates"]:
            if "label" in entry and entry.get("valid", True):
                entry["throughput"] = speed_json(speeds.get(entry["label"]))
        return out
    base = baseline_candidate(study.training)
    baseline = next((v for v in verdicts if v.candidate == base), None) or evaluate(
        candidate=base, model=study.model, hardware=study.hardware, training=study.training)
    if baseline.ledger is None:
        out: dict[str, object] = {"candidate": base.knobs(), "label": base.label(), "valid": False, "fits": False,
                                  "reasons": list(baseline.invalid_reasons)}
    else:
        out = ledger_json(baseline.ledger)
        out["throughput"] = speed_json(speed(study, base))
    out["study"] = study.name
    out["parameters"] = psi(study)
    out["inventory"] = inventory_json(study)
    out["plan"] = plan_json(verdicts, speeds=speeds)
    return out


def _ledger_calibrated(study: StudySpec, args: argparse.Namespace) -> int:
    from optimizer.search.calibration_report import calibration_table
    from optimizer.search.ordering import study_models

    if isinstance(study.model, SeedModel):
        raise UserError(source=str(study.path), key="model.kind", why="calibration needs measured trials of a "
                        "transformer-mode model")
    stored = stored_study(study, args.storage)  # read-only: a missing storage is refused, never created
    study = prepared_study(study)
    trials = stored.get_trials(deepcopy=False)
    models = study_models(spec=study, trials=trials, base=baseline_candidate(study.training))
    print(calibration_table(spec=study, trials=trials, models=models))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    ledger = sub.add_parser("ledger", help="the plan: candidates that fit by predicted speed, the closest that do "
                            "not and why; with --set one candidate's itemised per-GPU / host / NVMe memory")
    ledger.add_argument("study", help="study file, e.g. studies/seed-1b-2x24gb.yaml")
    ledger.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                        help=f"set a knob (repeatable); knobs: {', '.join(KNOB_NAMES)}; others take the baseline")
    ledger.add_argument("--all", action="store_true", help="the full table: every candidate of the study's search "
                        "space (fitting by memory, then the rest, then the invalid ones)")
    ledger.add_argument("--invalid", action="store_true", help="under the plan, list every invalid candidate with "
                        "its reasons (the plan counts them by reason)")
    ledger.add_argument("--json", action="store_true", help="print JSON (integer bytes): one --set candidate's "
                        "ledger; without --set the baseline's ledger and the plan; with --all every candidate")
    ledger.add_argument("--calibrated", action="store_true", help="predicted vs measured per trial of the stored "
                        "study, before and after the study's calibration")
    ledger.add_argument("--storage", default=None, help="with --calibrated: the study's storage URL "
                        "(default: its sqlite file)")
    ledger.set_defaults(run=run)
