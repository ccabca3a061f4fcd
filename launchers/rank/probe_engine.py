"""DeepSpeed's engine timed by the probe on one rank: a micro-step that accumulates and one that steps, at each ZeRO
stage the probe's plan lists (:mod:`optimizer.perf.skeleton`: the study's model at a tiny width), built as a trial's
engine is. Called by :func:`launchers.rank.probe_rank.run` last, after the kernels and the model passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from launchers.measure.gc_pauses import settle_heap
from launchers.rank.probe_pass import skip_reason

Once = Callable[[Callable[[], object], int], float]
"""Seconds of ``repeats`` runs of an operation in a row (:meth:`launchers.rank.probe_rank.Timer.once`)."""


def engine_rounds(once: Once, engine: dict[str, Any], *, rounds: int,
                  device: Any) -> tuple[list[float], list[float]]:
    """Per round (``rounds`` of them), seconds of a micro-step that only accumulates and of one that steps the optimizer
    (``engine``: a skeleton's rank plan with 2 micro-steps per step, :mod:`optimizer.perf.skeleton`), on DeepSpeed's
    engine built as a trial's is (:func:`launchers.models.builtin.build_workload`, ``deepspeed.initialize``). One
    step warms it up first (it builds the buckets and, at ZeRO-3, traces the module order the prefetch follows).
    Every rank runs the same calls: they are collectives."""
    import deepspeed
    import deepspeed.comm as dist

    from launchers.models.builtin import build_workload

    config = engine["config"]
    model, batch_fn = build_workload(model_spec=engine["model"], checkpointing=engine["checkpointing"],
                                     sequence_length=engine["sequence_length"], seed=engine["seed"], entry_point=None,
                                     construction=engine["construction"], ds_config=config, device=device)
    trained, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                      if p.requires_grad], config=config)
    rows = int(engine["model"].get("sequences_per_sample", 1))
    first = dist.get_rank() * rows
    batch = batch_fn(0, list(range(first, first + rows))).to(trained.device)

    def micro_step() -> None:
        trained.backward(trained(batch))
        trained.step()

    for _ in range(config["gradient_accumulation_steps"]):
        micro_step()
    accumulating, stepping = [], []
    for _ in range(rounds):  # no collection falls here: the probe runs with automatic collection off (probe_rank.run)
        dist.barrier()
        accumulating.append(once(micro_step, 1))
        stepping.append(once(micro_step, 1))
    return accumulating, stepping


def engines_timed(once: Once, engines: Sequence[dict[str, Any]], *, rounds: int, precision: str,
                  device: Any) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Each engine of ``engines`` (its plan's precision, else ``precision``) timed by :func:`engine_rounds`: an
    ``engine_micro`` and an ``engine_step`` figure per engine, and each engine that could not run (skipped, with
    why: fp16 on a CPU without it), the others' figures kept."""
    import deepspeed.comm as dist
    import torch

    figures: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    for engine in engines:
        checkpointed = "" if engine["checkpointing"] == "none" else f" ckpt={engine['checkpointing']}"
        variant = f"z{engine['stage']}{checkpointed}"
        what = {"precision": engine.get("precision", precision), "variant": variant, "work": 1}
        dist.barrier()
        try:
            accumulating, stepping = engine_rounds(once, engine, rounds=rounds, device=device)
        except Exception as err:  # a stage this machine cannot run (fp16 on a CPU without it) is a finding
            skipped.append({"what": f"engine {variant} {what['precision']}", "why": skip_reason(err)})
            continue
        finally:  # the engine freed before the next one is built (ZeRO-3's hooks hold it in cycles; its device memory
            settle_heap()  # on GPUs), by a collection of what the probe made since its last one (probe_rank.run)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        figures.append({"kind": "engine_micro", **what, "rounds_s": accumulating})
        figures.append({"kind": "engine_step", **what, "rounds_s": stepping})
    return figures, skipped
