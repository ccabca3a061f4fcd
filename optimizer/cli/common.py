"""What several commands share: loading the study as the commands need it, ``--set``, argument types, the
one-line usage error."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn

from optimizer.ledger.transformer import parameter_count
from optimizer.perf.throughput import StepTime, predict_candidate
from optimizer.search.storage import load_stored
from optimizer.study.constraints import invalid_reasons
from optimizer.study.errors import UserError
from optimizer.study.knobs import KNOB_NAMES, Candidate, parse_knob
from optimizer.study.specs import SeedModel, TransformerModel, baseline_candidate
from optimizer.study.study_file import StudySpec, load_study

if TYPE_CHECKING:
    import optuna

    from launchers.trial.node_share import WorkerSlot

class Parser(argparse.ArgumentParser):
    """argparse with a usage mistake as one line (what is wrong, and where the help is), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

def parse_sets(pairs: Sequence[str], *, base: Candidate) -> Candidate:
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

def psi(study: StudySpec) -> int:
    return study.model.parameters if isinstance(study.model, SeedModel) else parameter_count(study.model)

def counted(study: StudySpec) -> StudySpec:
    """The study with its model's parameter inventory when its code builds it (torch is imported only then)."""
    if isinstance(study.model, TransformerModel) and study.model.counted_from_code:
        from launchers.trace.inventory import with_inventory

        return with_inventory(study)
    return study

def prepared_study(study: StudySpec, *, candidates: Sequence[Candidate] | None = None,
                   also: Sequence[Candidate] = ()) -> StudySpec:
    """The (already checked) study with the parameter inventory of a ``transformers`` or entry-point model (built
    on fake tensors, cached; one warning and the shape's layout when it cannot be built) and its model traced when
    it says ``activations: trace`` or ``auto``, the default (cached; a failed trace warns on stderr and leaves the
    formula in place) — for ``candidates`` only when given (one ``--set``), else for the whole search space and
    the candidates in ``also`` (a trial's ``--set``, which may lie outside it); and this machine's probe of its
    shapes where ``dsopt probe`` or a study has cached one (never run here: :mod:`launchers.probe.machine`).

    This is the first step that builds or writes anything: every command checks all its input before it."""
    study = counted(study)
    if isinstance(study.model, TransformerModel) and study.model.wants_trace:
        from launchers.trace.study_traces import with_traced_activations

        study = with_traced_activations(study, candidates=candidates, also=also)
    if isinstance(study.model, TransformerModel):
        from launchers.probe.machine import with_cached_probe

        study = with_cached_probe(study)
    return study


def runnable_model(study: StudySpec, *, what: str) -> None:
    """Refuse (exit 2) a seed-mode study for a command that runs or traces its model."""
    if isinstance(study.model, SeedModel):
        raise UserError(source=str(study.path), key="model.kind", why=f"a seed-mode model has no shape to {what}; "
                        "this needs model.kind: transformer")


def checked_candidate(study: StudySpec, sets: Sequence[str]) -> Candidate:
    """The candidate of ``--set`` over the study's baseline, refused (exit 2) when it is invalid for the study —
    checked on the study as written, before anything is built (the constraints read the model's shape only)."""
    candidate = parse_sets(sets, base=baseline_candidate(study.training))
    reasons = invalid_reasons(candidate=candidate, model=study.model, hardware=study.hardware,
                              training=study.training)
    if reasons:
        raise invalid_candidate(study, candidate, reasons, sets=sets)
    return candidate


def refuse_together(args: argparse.Namespace, flag: str, *others: str, why: str) -> None:
    """Exit 2 when ``flag`` is given with any of ``others`` (argparse attribute names, flags as typed)."""
    if not getattr(args, flag.lstrip("-").replace("-", "_")):
        return
    for other in others:
        value = getattr(args, other.lstrip("-").replace("-", "_"))
        if value:
            raise UserError(source=flag, key=other, why=why)

def invalid_candidate(study: StudySpec, candidate: Candidate, reasons: Sequence[str], *,
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

def inventory_json(study: StudySpec) -> dict[str, object] | None:
    """The parameter inventory's summary for ``--json`` (None: the shape's layout or seed mode)."""
    inventory = study.model.inventory if isinstance(study.model, TransformerModel) else None
    if inventory is None:
        return None
    name, largest = inventory.largest_module()
    return {"source": inventory.source, "model_class": inventory.model_class, "parameters": inventory.parameters,
            "tensors": len(inventory.tensors), "largest_module": {"name": name, "elements": largest},
            "by_module_type": [{"module_type": t, "tensors": n, "elements": e}
                               for t, n, e in inventory.by_module_type()],
            "tied": [list(group) for group in inventory.tied],
            "trainable": inventory.trainable_parameters, "frozen": inventory.frozen_parameters,
            "trainable_tensors": sum(t.trainable for t in inventory.tensors),
            "four_bit": inventory.four_bit_parameters, "four_bit_tensors": sum(t.four_bit for t in inventory.tensors)}

def speed(study: StudySpec, candidate: Candidate) -> StepTime | str:
    if isinstance(study.model, SeedModel):
        return "unknown: a seed-mode model has no shape to count work on"
    return predict_candidate(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)

def speed_json(speed: StepTime | str | None) -> dict[str, object]:
    if not isinstance(speed, StepTime):
        return {"known": False, "reason": speed or "not evaluated"}
    return {"known": True, "tokens_per_s": speed.tokens_per_s, "step_s": speed.total_s,
            "terms_s": dict(speed.terms_s), "source": speed.source}

def runnable_study(path: str, *, slot: WorkerSlot | None = None) -> tuple[StudySpec, tuple[str, ...] | None]:
    """The study file and this worker's GPU slice (None: CPU ranks or whole nodes), refused (exit 2) if it
    cannot run trials here."""
    from launchers.trial.run import check_devices
    from optimizer.search.space import branches

    study = load_study(path)
    runnable_model(study, what="run")
    gpus = check_devices(study, slot=slot)
    branches(study)  # an empty search space is refused before the model is counted or the storage opened
    return counted(study), gpus  # traced by run_study, once the storage is open

def shared_storage(args: argparse.Namespace) -> str:
    from launchers.cluster.slurm import STORAGE_VAR

    storage = args.storage or os.environ.get(STORAGE_VAR)
    if not storage:
        raise UserError(source="--storage", key="", why=f"workers share a storage: give --storage URL or set "
                        f"${STORAGE_VAR} (postgresql+psycopg://USER@HOST/DB or journal:///shared/file.log)")
    return storage

def slot(text: str) -> WorkerSlot:
    from launchers.trial.node_share import parse_slot

    try:
        return parse_slot(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None

def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)

def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value

def progress_flags(parser: argparse.ArgumentParser) -> None:
    """``--quiet`` / ``--jsonl``: what a running study prints (launchers/study/progress.py)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quiet", action="store_true", help="no line per trial: only when the worker waits or "
                       "stops, errors, and the summary")
    group.add_argument("--jsonl", action="store_true", help="one JSON object per finished trial on stdout (for "
                       "scripts); everything else on stderr")

def stored(study: StudySpec, storage: str | None) -> tuple[optuna.Study, Any]:
    """The study's stored trials and the storage they were read from, read-only: a missing file or a database
    without Optuna's tables is refused (:func:`optimizer.search.storage.load_stored`), never created."""
    return load_stored(name=study.name, default_path=study.output_dir / "study.db", storage=storage,
                       study_path=study.path)


def stored_study(study: StudySpec, storage: str | None) -> optuna.Study:
    """:func:`stored`'s study alone."""
    return stored(study, storage)[0]
