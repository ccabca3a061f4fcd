"""A trial that runs the user's own training script (``trial.command``): what its ranks are told, the command line
of one candidate, and the figures only the script knows (docs/trials.md, "Your own training script").

:func:`launchers.trial.run.run_trial` starts it the way it starts a built-in trial — the same torchrun/SLURM launch
plan, devices, timeout and classification — with the filled command as the rank program
(:func:`launchers.trial.local.build_launch_plan`'s ``rank_command``) and :mod:`launchers.rank.script_hook` measuring
it. The script runs in the study file's folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from optimizer.ledger.transformer import parameter_count
from optimizer.results.export import hf_auto
from optimizer.results.loss_scaling import skip_allowance
from optimizer.results.trial_result import TrialResult
from optimizer.study.knobs import Candidate, EveryKCheckpointing, FullCheckpointing, NoCheckpointing, OffloadDevice
from optimizer.study.script_command import command_values, substitute
from optimizer.study.specs import TransformerModel
from optimizer.study.study_file import StudySpec


def script_path(study: StudySpec) -> Path | None:
    """The script file the command runs (``python X.py …`` or ``X.py …``), where there is one."""
    assert study.trial.command is not None
    name = study.trial.command.script
    return None if name is None or not (study.path.parent / name).is_file() else study.path.parent / name


def checkpoint_calls(candidate: Candidate, layers: int) -> int | None:
    """Checkpointed blocks per forward the candidate asks of a model of ``layers`` blocks (None: not a count)."""
    match candidate.checkpointing:
        case NoCheckpointing():
            return 0
        case FullCheckpointing():
            return layers
        case EveryKCheckpointing(k=k):
            return layers // k
    return None


def script_plan(study: StudySpec, candidate: Candidate, config: dict[str, Any]) -> dict[str, Any]:
    """What the hook checks and reads (:mod:`launchers.rank.script_hook`), and what keys the FP32 reference
    of a script study: the command, its JSON style and the script's own bytes (an edited script is measured anew)."""
    command = study.trial.command
    assert command is not None and isinstance(study.model, TransformerModel)
    script = script_path(study)
    return {
        "command": list(command.argv),
        "ds_config_style": command.ds_config_style,
        "script_sha256": hashlib.sha256(script.read_bytes()).hexdigest() if script else None,
        "planned_parameters": parameter_count(study.model),
        "expect": {
            "micro_batch_size": candidate.micro_batch_size,
            "rows_per_micro_batch": study.model.rows(candidate.micro_batch_size),
            "gradient_accumulation_steps": config["gradient_accumulation_steps"],
            "zero_stage": int(candidate.zero_stage),
            "precision": str(candidate.precision),
            "offload_optimizer": str(candidate.offload_optimizer) if candidate.offload_optimizer
            is not OffloadDevice.NONE else "none",
            "offload_param": str(candidate.offload_param) if candidate.offload_param is not OffloadDevice.NONE
            else "none",
            "checkpointing": str(candidate.checkpointing),
            "checkpoint_calls": checkpoint_calls(candidate, study.model.layers),
        },
    }


def script_command(study: StudySpec, candidate: Candidate, *, launch_config: dict[str, Any],
                   trial_dir: Path) -> tuple[str, ...]:
    """The candidate's command line: the JSON the script gets written beside the trial's ``ds_config.json`` —
    ``ds_config.run.json``, the launch's own (its NVMe swap folder), in the study's style (``hf``: "auto" batch
    sizes, :func:`optimizer.results.export.hf_auto`) — and every placeholder filled."""
    command = study.trial.command
    assert command is not None
    given = hf_auto(launch_config) if command.ds_config_style == "hf" else launch_config
    path = trial_dir / "ds_config.run.json"
    path.write_text(json.dumps(given, indent=2) + "\n")
    trial = study.trial
    steps = trial.warmup_steps + trial.measured_steps + skip_allowance(launch_config.get("fp16")) + 1
    values = command_values(candidate=candidate, ds_config=str(path.resolve()), trial_dir=str(trial_dir.resolve()),
                            global_batch_size=study.training.global_batch_size,
                            world_size=study.hardware.world_size, seed=trial.seed, max_steps=steps,
                            sequence_length=study.training.sequence_length)
    return substitute(command.argv, values)


def script_tokens_per_step(study: StudySpec, reports: dict[int, dict[str, Any]]) -> int:
    """Tokens per optimizer step: what the hook counted in the batches the engine saw, else ``tokens_per_sample``
    (default: the sequence length) × the rows of the global batch (``training.sequences_per_sample`` each)."""
    counted = next((r.get("tokens_per_step") for _, r in sorted(reports.items()) if r.get("tokens_per_step")), None)
    if counted:
        return int(counted)
    command = study.trial.command
    per_sample = (command.tokens_per_sample if command else None) or study.training.sequence_length
    return per_sample * study.model.rows(study.training.global_batch_size)


def with_script_counts(study: StudySpec, result: TrialResult, reports: dict[int, dict[str, Any]]) -> TrialResult:
    """``result`` with the parameter counts a script trial's hook reported (the first rank that has them); as it is
    for dsopt's own step."""
    if study.trial.command is None or not reports:
        return result
    first = {name: next((r.get(name) for _, r in sorted(reports.items()) if r.get(name)), None)
             for name in ("script_parameters", "script_trainable_parameters")}
    return dataclasses.replace(result, **first)
