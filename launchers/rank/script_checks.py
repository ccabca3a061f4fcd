"""What the script hook checks, without a rank (:mod:`launchers.rank.script_hook`): whether a process is a
rank to measure, whether the engine the script built is the candidate's, whether its forward recomputes as the
candidate's ``checkpointing`` asks, and what batch a forward sees and whether it is the candidate's."""

from __future__ import annotations

import os
from typing import Any

from launchers.rank.script_vars import ACTIVE_VAR, PLAN_VAR


def wanted(env: dict[str, str] | os._Environ[str]) -> bool:
    """Whether this process is a rank of a script trial that no hook measures yet."""
    return bool(env.get(PLAN_VAR)) and "LOCAL_RANK" in env and "GROUP_RANK" in env and ACTIVE_VAR not in env


def engine_mismatches(plan: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Every knob where the engine the script built differs from the candidate (pure): ``actual`` holds the
    engine's ``micro_batch_size``, ``gradient_accumulation_steps``, ``zero_stage``, ``precision``,
    ``offload_optimizer`` and ``offload_param``; ``plan["expect"]`` the candidate's."""
    expected = plan["expect"]
    return [f"{knob}: the candidate's is {expected[knob]}, the script's engine runs {actual[knob]}"
            for knob in ("micro_batch_size", "gradient_accumulation_steps", "zero_stage", "precision",
                         "offload_optimizer", "offload_param") if str(actual[knob]) != str(expected[knob])]


def offload_device(offload: Any) -> str:
    """The device of an engine's ``offload_optimizer``/``offload_param`` section, ``none`` where there is none.

    DeepSpeed 0.19.8's config models use ``use_enum_values=True`` (``runtime/config_utils.py:108``), so
    ``device`` is the plain string (``"cpu"``), not ``OffloadDeviceEnum`` (``runtime/zero/offload_config.py:14-24``);
    an enum member, as other releases may keep, is read by its value."""
    if offload is None:
        return "none"
    device = offload.device
    return str(getattr(device, "value", device))


def engine_knobs(engine: Any) -> dict[str, Any]:
    """The knobs a DeepSpeed engine runs, as :func:`engine_mismatches` compares them (engine.py's accessors)."""
    return {
        "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "zero_stage": int(engine.zero_optimization_stage()),
        "precision": "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32",
        "offload_optimizer": offload_device(engine.zero_offload_optimizer()),
        "offload_param": offload_device(engine.zero_offload_param()),
    }


def checkpointing_mismatch(plan: dict[str, Any], calls: list[int]) -> str | None:
    """Why the checkpoint calls counted per forward do not match the candidate's ``checkpointing`` (pure):
    ``none`` makes none; anything else makes some, and exactly ``plan["expect"]["checkpoint_calls"]`` per forward
    where the plan knows it (the model section's blocks: full → every block, every_K → one in K)."""
    knob, exact = plan["expect"]["checkpointing"], plan["expect"].get("checkpoint_calls")
    if not calls:
        return None
    seen = max(calls)
    if knob == "none":
        return None if seen == 0 else (f"checkpointing: the candidate's is none, the script's forward checkpointed "
                                       f"{seen} block(s)")
    if seen == 0 or (exact is not None and seen != exact):
        want = f"{exact} checkpointed block(s) per forward" if exact is not None else "recomputation"
        return (f"checkpointing: the candidate's is {knob} ({want}), the script's forward checkpointed {seen} "
                "(does the command pass {checkpointing} or {gradient_checkpointing} to the script?)")
    return None



def batch_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int | None, int | None]:
    """(tokens, samples) of the batch a forward sees: its ``input_ids`` (else the first integer tensor)."""
    import torch

    candidates = [kwargs.get("input_ids"), *args, *kwargs.values()]
    if args and isinstance(args[0], dict):
        candidates.insert(0, args[0].get("input_ids"))
    for value in candidates:
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and not value.is_floating_point():
            return int(value.numel()), int(value.shape[0])
    return None, None


def ended_early(*, engine_seen: bool, frozen_engines: int, done: int, warmup: int, measured: int) -> str:
    """Why a script that ended on its own left the trial without figures: no engine (or only ``frozen_engines``
    made without an optimizer, a reference model's), or fewer optimizer steps than warm-up + measured."""
    if not engine_seen and frozen_engines:
        return (f"the script made {frozen_engines} DeepSpeed engine(s) without an optimizer (a frozen model's) and "
                "none that trains: the hook measures the one built with an optimizer from {ds_config}")
    if not engine_seen:
        return ("the script never called deepspeed.initialize: dsopt's hook saw no DeepSpeed engine (does the script "
                "train with DeepSpeed — directly, through the HF Trainer or Accelerate — and pass it {ds_config}?)")
    return (f"the script ended after {done} optimizer step(s); the trial measures {warmup + measured} (warm-up "
            f"{warmup} + measured {measured}): let it run at least {{max_steps}} steps (a placeholder for the "
            "script's step limit)")


def batch_mismatch(plan: dict[str, Any], first_batch: int | None) -> str | None:
    """Why the rows of the first batch the engine's forward saw are not the candidate's micro-batch (pure):
    ``plan["expect"]["micro_batch_size"]`` samples of ``training.sequences_per_sample`` rows each
    (``rows_per_micro_batch``; a DPO pair runs as two). A batch that is a multiple of a one-row micro-batch hints
    at the key."""
    expect = plan["expect"]
    micro = expect["micro_batch_size"]
    rows = expect.get("rows_per_micro_batch", micro)
    if first_batch is None or first_batch == rows:
        return None
    sequences = f" samples of {rows // micro} sequences each: {rows} rows" if rows != micro else ""
    hint = (" — does each sample run as several sequences (a DPO pair runs its chosen and rejected completions)? "
            "Set training.sequences_per_sample" if rows == micro and first_batch % micro == 0 else "")
    return (f"micro_batch_size: the candidate's is {micro}{sequences}, the script fed its engine batches of "
            f"{first_batch} rows (does the command pass {{micro_batch_size}}, or does the script take the batch size "
            f"from the DeepSpeed config?){hint}")
