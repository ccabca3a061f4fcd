"""The search space as Optuna sees it: the branches of knobs that may vary, sampling a candidate from a trial, and
the trial parameters of a candidate (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import optuna

from optimizer.study.errors import UserError
from optimizer.study.knobs import Candidate, OffloadDevice, ZeroStage, parse_knob
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import StudySpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Branches:
    """The values each knob may take, per ZeRO stage where DeepSpeed restricts them."""

    stages: tuple[ZeroStage, ...]
    offload_optimizer: dict[ZeroStage, tuple[OffloadDevice, ...]]
    offload_param: tuple[OffloadDevice, ...]
    precision: tuple[str, ...]
    checkpointing: tuple[str, ...]
    micro_batch_size: tuple[int, ...]


def branches(study: StudySpec) -> Branches:
    """Restrict the study's space to what DeepSpeed and the study allow; UserError if nothing is left."""
    base = baseline_candidate(study.training)
    values = dict(study.search_space.values)

    def listed(name: str, default: object) -> tuple:
        return tuple(values.get(name, (default,)))

    def allowed_offload(stage: ZeroStage) -> tuple[OffloadDevice, ...]:
        options = listed("offload_optimizer", base.offload_optimizer)
        ok = {ZeroStage.DISABLED: {OffloadDevice.NONE}, ZeroStage.OPTIMIZER: {OffloadDevice.NONE, OffloadDevice.CPU},
              ZeroStage.GRADIENTS: {OffloadDevice.NONE, OffloadDevice.CPU}}.get(stage, set(OffloadDevice))
        return tuple(o for o in options if o in ok and (o is not OffloadDevice.NVME or study.hardware.nvme_path))

    stages = tuple(s for s in listed("zero_stage", base.zero_stage) if allowed_offload(s))
    params = tuple(o for o in listed("offload_param", base.offload_param)
                   if o is not OffloadDevice.NVME or study.hardware.nvme_path)
    if ZeroStage.PARAMETERS in stages and not params:
        stages = tuple(s for s in stages if s is not ZeroStage.PARAMETERS)
    if ZeroStage.PARAMETERS not in stages:
        params = (OffloadDevice.NONE,)
    precisions = tuple(str(p) for p in listed("precision", base.precision) if p in study.hardware.supported_precisions)
    ranks = study.hardware.world_size
    mbs = tuple(m for m in listed("micro_batch_size", base.micro_batch_size)
                if study.training.global_batch_size % (m * ranks) == 0)
    ckpt = tuple(str(c) for c in listed("checkpointing", base.checkpointing))
    result = Branches(stages=stages, offload_optimizer={s: allowed_offload(s) for s in stages},
                      offload_param=params, precision=precisions, checkpointing=ckpt, micro_batch_size=mbs)
    empty = [name for name, value in (("zero_stage", stages), ("precision", precisions),
                                      ("micro_batch_size", mbs)) if not value]
    if empty:
        raise UserError(source=study.search_space.source, key=f"knobs.{empty[0]}",
                        why="no value left that DeepSpeed and this study's hardware/batch allow: the search space "
                            "is empty after validation")
    return result


def _pick(trial: optuna.Trial, name: str, choices: Sequence[Any]) -> Any:
    return choices[0] if len(choices) == 1 else trial.suggest_categorical(name, list(choices))


def sample_candidate(trial: optuna.Trial, space: Branches, base: Candidate) -> Candidate:
    """One DeepSpeed-valid candidate, conditional knobs under their own parameter names."""
    stage = ZeroStage(_pick(trial, "zero_stage", [int(s) for s in space.stages]))
    optimizer = OffloadDevice(_pick(trial, f"offload_optimizer_z{int(stage)}",
                                    [o.value for o in space.offload_optimizer[stage]]))
    param = OffloadDevice(_pick(trial, "offload_param_z3", [o.value for o in space.offload_param])) \
        if stage is ZeroStage.PARAMETERS else OffloadDevice.NONE
    return replace(
        base, zero_stage=stage, offload_optimizer=optimizer, offload_param=param,
        precision=parse_knob("precision", _pick(trial, "precision", list(space.precision))),
        checkpointing=parse_knob("checkpointing", _pick(trial, "checkpointing", list(space.checkpointing))),
        micro_batch_size=_pick(trial, "micro_batch_size", list(space.micro_batch_size)),
    )


def distribution_params(candidate: Candidate, space: Branches) -> dict[str, Any]:
    """The Optuna parameters that make ``sample_candidate`` return ``candidate`` (for enqueueing)."""
    params: dict[str, Any] = {}
    stage = candidate.zero_stage
    if len(space.stages) > 1:
        params["zero_stage"] = int(stage)
    if len(space.offload_optimizer[stage]) > 1:
        params[f"offload_optimizer_z{int(stage)}"] = candidate.offload_optimizer.value
    if stage is ZeroStage.PARAMETERS and len(space.offload_param) > 1:
        params["offload_param_z3"] = candidate.offload_param.value
    for name, choices, value in (("precision", space.precision, str(candidate.precision)),
                                 ("checkpointing", space.checkpointing, str(candidate.checkpointing)),
                                 ("micro_batch_size", space.micro_batch_size, candidate.micro_batch_size)):
        if len(choices) > 1:
            params[name] = value
    return params


def in_space(candidate: Candidate, space: Branches) -> bool:
    return (candidate.zero_stage in space.stages
            and candidate.offload_optimizer in space.offload_optimizer[candidate.zero_stage]
            and candidate.offload_param in space.offload_param
            and str(candidate.precision) in space.precision
            and str(candidate.checkpointing) in space.checkpointing
            and candidate.micro_batch_size in space.micro_batch_size)
