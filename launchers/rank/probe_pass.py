"""The probe's model passes on one rank (:mod:`optimizer.perf.model_pass`): the study's model built as a trial builds
it, a few blocks deep, cast as DeepSpeed's engine casts it, its forward and backward timed with autograd alone.

Called by :func:`launchers.rank.probe_rank.run` with one precision's plan (:func:`launchers.probe.machine.pass_plans`):
the model is built once (:func:`launchers.models.builtin.build_workload`: PEFT, a 4-bit base, frozen parameters as in
a trial), then each pass — every micro-batch of the space and the intercept — is timed in the probe's rounds
(:class:`launchers.rank.probe_rank.Timer`). Gradients accumulate across the runs, as they do across a step's
micro-steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from launchers.measure.gc_pauses import settle_heap


def skip_reason(err: BaseException) -> str:
    """Why an operation of the probe was skipped, in one line: the exception's type and its message's first line (200
    characters). Every skip the probe writes (:mod:`launchers.rank.probe_rank`, :mod:`launchers.rank.probe_engine`)
    reads the same."""
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def cast_as_deepspeed(model: Any, precision: str) -> None:
    """``model``'s floating-point parameters in ``precision``'s dtype, its buffers as they are: DeepSpeed 0.19's cast
    of a bf16/fp16 engine (``runtime/engine.py`` ``_cast_module_mixed_precision``, ``CASTABLE_DTYPES``); an fp32
    engine casts nothing (a 4-bit base's bf16-stored packed weights stay as they are)."""
    import torch
    from deepspeed.runtime.engine import CASTABLE_DTYPES

    target = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if target is None:
        return
    for param in model.parameters():
        if param.dtype in CASTABLE_DTYPES and param.dtype != target:
            param.data = param.data.to(target)


def timed_pass(rounds: Callable[[Callable[[], object]], list[float]], model: Any, batch: Any) -> list[float]:
    """``rounds`` of one forward and backward of ``model`` on ``batch`` (no reference to either outlives it)."""
    return rounds(lambda: model(batch).backward())


def pass_figures(rounds: Callable[[Callable[[], object]], list[float]], plan: dict[str, Any], *,
                 device: Any) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Each pass of ``plan`` (one precision's, module doc) timed by ``rounds``: a figure per pass, its work the FLOPs of
    its terms, its terms as the plan counted them; and each pass that could not run (skipped, with why: a wide
    micro-batch that does not fit the card, say), the others' figures kept. The model goes to the device whole, as
    DeepSpeed's engine moves it (``runtime/engine.py`` ``_configure_distributed_model``): a 4-bit base is built on
    the host and only its quantized layers placed on the device (:func:`launchers.models.builtin.build_workload`)."""
    import torch

    from launchers.models.builtin import build_workload

    model, batch_fn = build_workload(model_spec=plan["model"], checkpointing=plan["checkpointing"],
                                     sequence_length=plan["sequence_length"], seed=plan["seed"], entry_point=None,
                                     construction=plan["construction"], ds_config=plan["config"], device=device)
    model.to(device)
    cast_as_deepspeed(model, plan["precision"])
    model.train()
    figures: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    for one in plan["passes"]:
        what = f"model pass {plan['precision']} {one['variant'] or 'mbs=' + str(one['micro_batch'])}"
        batch = batch_fn(0, list(range(one["rows"])))[:, :one["tokens"] + 1].to(device)
        flops = sum(amount for name, amount in one["terms"] if name.startswith("flops"))
        try:
            seconds = timed_pass(rounds, model, batch)
        except Exception as err:  # a pass this card cannot run is a finding, not the probe's end
            skipped.append({"what": what, "why": skip_reason(err)})
            seconds = None
        del batch
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if seconds is not None:
            figures.append({"kind": "pass", "precision": plan["precision"], "micro_batch": one["micro_batch"],
                            "variant": one["variant"], "work": flops, "terms": one["terms"], "rounds_s": seconds})
    del model
    settle_heap()  # the model freed, what its build imported frozen (launchers.rank.probe_rank.run)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return figures, skipped
