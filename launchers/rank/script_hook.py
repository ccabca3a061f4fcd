"""Measure a user's own training script from the outside: the hook ``sitecustomize`` installs in each rank.

A study with ``trial.command`` runs the user's script on the candidate's ranks (:mod:`launchers.trial.run`) with
``launchers/trial/script_site`` first on ``PYTHONPATH``; its ``sitecustomize`` calls :func:`install` in every rank
process torchrun starts (``LOCAL_RANK`` and ``GROUP_RANK`` set, :data:`PLAN_VAR` naming the trial's plan) and in
no other — not torchrun's agent, not a process the script spawns (:data:`ACTIVE_VAR`). The script is not edited.

What the hook does, in order:

* seeds ``torch``, ``random`` and ``numpy`` with the trial's seed (the script may seed again: its own order wins);
* starts the measurement before the script runs a line: CUDA's peak statistics, or on CPU ranks the profiler with
  c10's all-thread counter (:mod:`launchers.measure.cpu_memory`), as the built-in trial does;
* counts ``torch.utils.checkpoint.checkpoint`` calls (and DeepSpeed's ``deepspeed.checkpointing.checkpoint``,
  patched when ``deepspeed`` is imported) per forward of the engine;
* wraps ``deepspeed.initialize`` — which the Hugging Face Trainer and Accelerate call too
  (accelerate/accelerator.py ``_prepare_deepspeed``: ``ds_initialize = deepspeed.initialize``). Its return ends the
  init phase (the init peaks are read there) and its engine is checked against the candidate: micro-batch,
  gradient accumulation, ZeRO stage, precision, optimizer and parameter offload (:func:`engine_mismatches`); a
  difference is a trial error naming the knob. An engine with no optimizer (``engine.py:560``) is a frozen model's
  (DPO's reference, wrapped by TRL's ``prepare_deepspeed`` first): it is let pass, the next one is the candidate's;
* wraps the engine's ``forward`` (the tokens and the batch it sees, the checkpoint calls), ``backward`` (the loss
  it is given) and ``step``: an optimizer step is a step that advanced ``engine.global_steps`` (engine.py:3558,
  overflow-skipped steps included, as DeepSpeed counts them). After each: the loss — per rank the sum of the
  micro-batches' shares, each the argument divided by the accumulation where DeepSpeed divides it, as given where
  the script did (``scale_wrt_gas=False``); then the mean of the ranks — the gradient norm, whether it was
  applied, the fp16 loss scale; the step's time is the wall time since the previous optimizer step ended — the
  script's whole step, its data loading included; after the warm-up the CPU profiler stops (its peak covers the
  warm-up, as the built-in trial's), checkpointing and the batch are checked and the heap is settled
  (:mod:`launchers.measure.gc_pauses`); after warm-up + measured steps the rank writes ``rank<r>.json`` in the
  built-in trial's format (:mod:`launchers.rank.trial_rank`), meets the others, exits 0.

What the hook cannot see is an error, not a figure: a script that never calls ``deepspeed.initialize`` or ends
early writes a ``crash`` report saying so; an uncaught exception is classified (:func:`trial_rank.classify`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import random
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from launchers.measure.gc_pauses import GcPauses
from launchers.measure.rng_draws import DrawWatch
from launchers.process.after_import import AfterImport
from launchers.rank.script_checks import (
    batch_mismatch,
    batch_shape,
    checkpointing_mismatch,
    ended_early,
    engine_knobs,
    engine_mismatches,
)
from launchers.rank.script_vars import ACTIVE_VAR, OUT_VAR, PLAN_VAR

INIT_MARK = "dsopt.init"
"""The profiler marker at the end of ``deepspeed.initialize``: the init phase ends there."""


@dataclass
class _State:
    plan: dict[str, Any]
    out_dir: Path
    rank: int
    cuda: bool
    started: float
    device_memory: Any = None
    profiler: Any = None
    engine: Any = None
    frozen_engines: int = 0  # made without an optimizer before the trained one: a reference (module doc)
    reported: bool = False
    init: dict[str, Any] = field(default_factory=dict)
    peaks: Any = None
    ckpt_calls: int = 0
    forward_calls: list[int] = field(default_factory=list)
    first_batch: int | None = None
    step_losses: list[float] = field(default_factory=list)
    step_tokens: int = 0
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    applied: list[bool] = field(default_factory=list)
    loss_scales: list[float | None] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    done: int = 0
    last_boundary: float = 0.0
    draws: DrawWatch = field(default_factory=DrawWatch)  # training draws random numbers (rng_draws.py)
    pauses: GcPauses = field(default_factory=GcPauses)  # the measured steps' cyclic collections (gc_pauses.py)


_state: _State | None = None


def install() -> None:
    """Start measuring this rank (module doc); called once by ``sitecustomize``."""
    global _state
    os.environ[ACTIVE_VAR] = str(os.getpid())
    plan = json.loads(Path(os.environ[PLAN_VAR]).read_text())
    import torch

    from launchers.measure.device_identity import cuda_rank

    cuda = cuda_rank()
    state = _State(plan=plan, out_dir=Path(os.environ[OUT_VAR]), rank=int(os.environ.get("RANK", "0")), cuda=cuda,
                   started=time.perf_counter())
    from launchers.measure.device_memory import DeviceMemory

    state.device_memory = DeviceMemory.open(cuda=cuda, index=int(os.environ.get("LOCAL_RANK", "0")))
    _seed(int(plan["seed"]))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.reset_peak_memory_stats()
    else:
        from launchers.measure.cpu_memory import start_cpu_profiler

        state.profiler = start_cpu_profiler()
    _state = state
    import torch.utils.checkpoint

    torch.utils.checkpoint.checkpoint = _counting(torch.utils.checkpoint.checkpoint)
    sys.meta_path.insert(0, AfterImport("deepspeed", _patch_deepspeed))
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        _fail(error)
        previous(kind, error, tb)

    sys.excepthook = excepthook
    atexit.register(_at_exit)


def _seed(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy
        numpy.random.seed(seed)


def _counting(function: Any) -> Any:
    @functools.wraps(function)
    def checkpoint(*args: Any, **kwargs: Any) -> Any:
        if _state is not None:
            _state.ckpt_calls += 1
        return function(*args, **kwargs)

    return checkpoint


def _patch_deepspeed(deepspeed: ModuleType) -> None:
    real = deepspeed.initialize
    checkpointing = getattr(deepspeed, "checkpointing", None)
    if checkpointing is not None and hasattr(checkpointing, "checkpoint"):
        checkpointing.checkpoint = _counting(checkpointing.checkpoint)

    @functools.wraps(real)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if _state is not None and _state.engine is None:
            _state.frozen_engines += getattr(result[0], "basic_optimizer", None) is None  # module doc
            if getattr(result[0], "basic_optimizer", None) is not None:
                _on_engine(result[0])
        return result

    deepspeed.initialize = initialize


def _on_engine(engine: Any) -> None:
    """The init phase ends: read its peaks, check the engine against the candidate, wrap its step."""
    import torch

    state = _state
    assert state is not None
    if state.cuda:
        torch.cuda.synchronize()
    state.init["init_s"] = time.perf_counter() - state.started
    with torch.profiler.record_function(INIT_MARK):
        pass
    if state.cuda:
        state.init["init_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        state.init["init_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        state.device_memory.sample(init=True)
        torch.cuda.reset_peak_memory_stats()
    parameters = list(engine.module.parameters())
    state.init["built_partitioned"] = any(hasattr(p, "ds_id") for p in parameters)
    state.init["script_parameters"] = sum(int(getattr(p, "ds_numel", p.numel())) for p in parameters)
    state.init["script_trainable_parameters"] = sum(int(getattr(p, "ds_numel", p.numel())) for p in parameters
                                                    if p.requires_grad)
    state.engine = engine
    mismatches = engine_mismatches(state.plan, engine_knobs(engine))
    if mismatches:
        _finish("crash", error_type="NotTheCandidate", message="the script's DeepSpeed engine is not the candidate's "
                "(does the script pass {ds_config} to DeepSpeed?): " + "; ".join(mismatches), code=1)
    forward, backward, step = engine.forward, engine.backward, engine.step

    def wrapped_forward(*args: Any, **kwargs: Any) -> Any:
        state.ckpt_calls = 0
        tokens, batch = batch_shape(args, kwargs)
        if state.first_batch is None and batch is not None:
            state.first_batch = batch
        state.step_tokens += tokens or 0
        state.draws.before(watch=state.done < state.plan["warmup_steps"])  # the untimed warm-up only
        out = forward(*args, **kwargs)
        state.forward_calls.append(state.ckpt_calls)
        return out

    def wrapped_backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
        # The step's loss is the sum of what each micro-batch adds to it: DeepSpeed divides the argument by the
        # accumulation unless told the script did (scale_wrt_gas=False, engine.py:3382 — the HF Trainer's way,
        # transformers/trainer.py "Turning off loss scaling w.r.t. gradient accumulation when DeepSpeed is enabled").
        scaled = kwargs.get("scale_wrt_gas", args[1] if len(args) > 1 else True)
        value = float(loss.detach().float())
        state.step_losses.append(value / engine.gradient_accumulation_steps() if scaled else value)
        return backward(loss, *args, **kwargs)

    def wrapped_step(*args: Any, **kwargs: Any) -> Any:
        state.draws.after()  # each micro-step's forward and backward end here (DeepSpeed's step per micro-step)
        before = engine.global_steps
        out = step(*args, **kwargs)
        if engine.global_steps != before:
            _after_optimizer_step()
        return out

    engine.forward, engine.backward, engine.step = wrapped_forward, wrapped_backward, wrapped_step
    state.last_boundary = time.perf_counter()


def _after_optimizer_step() -> None:
    """One optimizer step ended: record it; stop the profiler after the warm-up; finish after the measured steps."""
    import torch
    import torch.distributed as dist

    from optimizer.results.loss_scaling import StepKind, min_loss_scale, skip_allowance, step_kind

    state, engine = _state, _state.engine if _state is not None else None
    assert state is not None and engine is not None
    if state.cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - state.last_boundary
    state.device_memory.sample()
    totals = torch.tensor([sum(state.step_losses), len(state.step_losses), state.step_tokens], dtype=torch.float64,
                          device=engine.device)
    if dist.is_initialized():
        dist.all_reduce(totals)
    loss = float(totals[0]) / (dist.get_world_size() if dist.is_initialized() else 1) if float(totals[1]) \
        else float("nan")
    state.step_losses, state.step_tokens = [], 0
    fp16 = state.plan["config"].get("fp16") if (state.plan["config"].get("fp16") or {}).get("enabled") else None
    norm = engine.get_global_grad_norm()
    applied = bool(engine.was_step_applied())
    scale = float(engine._get_optimizer_loss_scale()) if fp16 else None  # engine.py:3771-3776
    kind = step_kind(loss=loss, grad_norm=None if norm is None else float(norm), applied=applied, loss_scale=scale,
                     min_loss_scale=min_loss_scale(fp16))
    state.losses.append(loss)
    state.grad_norms.append(None if norm is None else float(norm))
    state.applied.append(applied)
    state.loss_scales.append(scale)
    warmup, measured = state.plan["warmup_steps"], state.plan["measured_steps"]
    if kind is StepKind.NONFINITE:
        _finish("nan", error_type="NonFiniteLoss", code=1, message=f"step {len(state.losses) - 1}: loss {loss}, "
                f"grad norm {norm}, applied {applied}, loss scale {scale}")
    if kind is StepKind.APPLIED:
        if state.done >= warmup:
            state.step_times.append(elapsed)
            state.tokens.append(int(totals[2]))
        state.done += 1
    if state.done == warmup and not state.pauses.watching:  # once, CPU and CUDA ranks alike
        _end_warmup()
    if state.done >= warmup + measured:
        _finish("ok")
    if len(state.losses) >= warmup + measured + skip_allowance(fp16):
        _finish("nan", error_type="NonFiniteLoss", code=1, message=f"fp16 loss scale never settled: "
                f"{state.applied.count(False)} of {len(state.applied)} steps skipped")
    state.last_boundary = time.perf_counter()


def _end_warmup() -> None:
    """After the warm-up: the CPU profiler's peaks, the script's recomputation and batch checked, the heap settled."""
    state = _state
    assert state is not None
    _end_warmup_peaks()
    wrong = checkpointing_mismatch(state.plan, state.forward_calls)
    if wrong:
        _finish("crash", error_type="NotTheCandidate", message=wrong, code=1)
    wrong = batch_mismatch(state.plan, state.first_batch)
    if wrong:
        _finish("crash", error_type="NotTheCandidate", code=1, message=wrong)
    state.pauses.settle_and_start()


def _measurements() -> dict[str, Any]:
    """The rank report's memory figures, as :mod:`launchers.rank.trial_rank` writes them."""
    import torch

    state = _state
    assert state is not None
    if state.cuda:
        trained = bool(state.losses)
        init_alloc = state.init.get("init_peak_allocated_bytes")
        init_reserved = state.init.get("init_peak_reserved_bytes")
        train_alloc = int(torch.cuda.max_memory_allocated()) if trained else None
        train_reserved = int(torch.cuda.max_memory_reserved()) if trained else None
        return {"init_peak_allocated_bytes": init_alloc, "init_peak_reserved_bytes": init_reserved,
                "training_peak_allocated_bytes": train_alloc, "training_peak_reserved_bytes": train_reserved,
                "peak_allocated_bytes": max(train_alloc or 0, init_alloc or 0),
                "peak_reserved_bytes": max(train_reserved or 0, init_reserved or 0)}
    _end_warmup_peaks()
    peaks = state.peaks
    return {"init_peak_allocated_bytes": peaks.until[INIT_MARK] if peaks else None, "init_peak_reserved_bytes": None,
            "training_peak_allocated_bytes": peaks.after[INIT_MARK] if peaks else None,
            "training_peak_reserved_bytes": None, "peak_allocated_bytes": peaks.peak if peaks else None,
            "peak_reserved_bytes": None}


def _end_warmup_peaks() -> None:
    """Stop the CPU profiler and keep its peaks: once (CUDA ranks run none)."""
    from launchers.measure.cpu_memory import stop_cpu_profiler

    state = _state
    if state is not None and state.profiler is not None:
        state.peaks = stop_cpu_profiler(state.profiler, ranges=(INIT_MARK,))
        state.profiler = None


def _report(status: str, **failure: Any) -> dict[str, Any]:
    import resource

    from launchers.measure.device_identity import device_identity

    state = _state
    assert state is not None
    report: dict[str, Any] = {
        "rank": state.rank, "node_rank": int(os.environ.get("GROUP_RANK", "0")), "host": socket.gethostname(),
        "status": status, "stopped_at": None, "over_limit": None, "device": "cuda" if state.cuda else "cpu",
        **device_identity(cuda=state.cuda), "construction": "script",
        "built_partitioned": state.init.get("built_partitioned"), "losses": state.losses,
        "grad_norms": state.grad_norms, "applied": state.applied, "loss_scales": state.loss_scales,
        "step_times_s": state.step_times, "init_s": state.init.get("init_s"),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "build_peak_allocated_bytes": None, "script_parameters": state.init.get("script_parameters"),
        "script_trainable_parameters": state.init.get("script_trainable_parameters"),
        "tokens_per_step": max(state.tokens) if state.tokens else None, "gc_pauses": state.pauses.finish(),
        "checkpoint_calls_per_forward": sorted(set(state.forward_calls)), "draws_random": state.draws.drew}
    if status == "ok":
        report.update(_measurements())
        report.update(state.device_memory.report())
    report.update(failure)
    return report


def _write(report: dict[str, Any]) -> None:
    from launchers.rank.probe_rank import write_report  # atomic, as the built-in trial's

    assert _state is not None
    _state.reported = True
    write_report(report, _state.out_dir / f"rank{_state.rank}.json")


def _finish(status: str, *, code: int = 0, **failure: Any) -> None:
    """Write this rank's report and end the script: ``ok`` once every rank met (none left in a collective)."""
    import torch.distributed as dist

    _write(_report(status, **failure))
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(code)


def _drop_profiler() -> None:
    """Stop a CPU profiler still running when the script ends on its own (a live one crashes the exit)."""
    if _state is not None and _state.profiler is not None:
        from launchers.measure.cpu_memory import count_every_thread

        _state.profiler.stop()
        _state.profiler = None
        count_every_thread(False)


def _fail(error: BaseException) -> None:
    """An exception the script did not catch: classified as the built-in trial's (never raises)."""
    if _state is None or _state.reported:
        return
    try:
        _drop_profiler()
        from launchers.rank.trial_rank import classify

        kind = classify(error, cpu_ranks=not _state.cuda)
        _write(_report(kind, error_type=type(error).__name__, message=str(error)[-2000:],
                       traceback="".join(traceback.format_exception(error))[-4000:]))
    except Exception:  # the script's own traceback still prints; the trial is a crash
        traceback.print_exc()


def _at_exit() -> None:
    """The script ended on its own before the hook finished it: say why the trial has no figures."""
    state = _state
    if state is None or state.reported:
        return
    why = ended_early(engine_seen=state.engine is not None, frozen_engines=state.frozen_engines, done=state.done,
                      warmup=state.plan["warmup_steps"], measured=state.plan["measured_steps"])
    try:
        _drop_profiler()
        _write(_report("crash", error_type="ScriptEnded", message=why))
    except Exception:  # never in the way of the script's own exit
        traceback.print_exc()
