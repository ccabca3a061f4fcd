"""The per-rank trial program: one short real DeepSpeed run, measured, then a clean teardown.

Started by :mod:`launchers.local` under ``torch.distributed.run`` (one process per rank) as
``python -m launchers.trial_rank PLAN.json OUT_DIR``. It writes ``OUT_DIR/rank<r>.json``:

* on success: peak memory (CUDA: ``max_memory_allocated`` and ``max_memory_reserved``; CPU ranks: the
  peak of live tensor bytes from the PyTorch profiler's allocation events (:mod:`launchers.cpu_memory`),
  recorded from before the model is built through the warm-up steps, and the process's peak RSS) over the
  whole run and over the init phase alone (construction + ``deepspeed.initialize``, ``init_peak_*``), the
  init time (``init_s``), per-step wall time of the measured steps — each step's batches are built before
  its clock starts — the loss of every step (mean over ranks and micro-batches), the gradient norm.
  The model is built as ``plan["construction"]`` says (:mod:`launchers.construction`);
* on failure: the failure kind, classified from the exception itself — ``oom``
  (``torch.OutOfMemoryError``, or the CPU allocator's ``RuntimeError``), ``unsupported`` (DeepSpeed's
  ``ValueError("Type fp16 is not supported on your device.")``), ``nan`` (a non-finite loss or gradient
  norm) — or ``crash`` for anything else, with the exception's text.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from launchers.cpu_memory import LivePeaks, start_cpu_profiler, stop_cpu_profiler
from launchers.orphan_guard import die_with_parent
from launchers.workload import build_workload

UNSUPPORTED_MARK = "is not supported on your device"
"""DeepSpeed engine.py: ``raise ValueError("Type fp16 is not supported on your device.")``."""
CPU_OOM_MARK = "DefaultCPUAllocator: can't allocate memory"
INIT_MARK = "dsopt.init"
"""The profiler range around model construction and ``deepspeed.initialize``: the init phase."""
BUILD_MARK = "dsopt.build"
"""The profiler range around model construction alone."""


class ModelBuildFailed(RuntimeError):
    """The model could not be built the way the construction says (e.g. an entry point that refuses zero.Init)."""


class NonFiniteLoss(RuntimeError):
    """A loss or gradient norm that is NaN or infinite."""


def classify(error: BaseException) -> str:
    """The failure kind of an exception raised inside the trial."""
    if isinstance(error, NonFiniteLoss):
        return "nan"
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return "oom"
    if isinstance(error, RuntimeError) and CPU_OOM_MARK in str(error):
        return "oom"
    if isinstance(error, ValueError) and UNSUPPORTED_MARK in str(error):
        return "unsupported"
    return "crash"


def _grad_norm(module: torch.nn.Module) -> float | None:
    """L2 norm of the parameters' gradients (ZeRO stage 0, where DeepSpeed reports none)."""
    grads = [p.grad.detach().double().norm() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else None


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _step_batches(batch_fn: Any, *, step: int, rank: int, micro: int, accumulation: int,
                  device: torch.device) -> list[Any]:
    """The step's micro-batches of this rank, built before the step is timed (data is not the workload)."""
    per_rank = micro * accumulation
    batches = []
    for micro_index in range(accumulation):
        first = rank * per_rank + micro_index * micro
        batch = batch_fn(step, list(range(first, first + micro)))
        batches.append(batch.to(device) if isinstance(batch, torch.Tensor) else batch)
    return batches


def run(plan: dict[str, Any], out_dir: Path, rank: int) -> dict[str, Any]:
    import deepspeed

    world = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    config = plan["config"]
    micro, accumulation = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    warmup, measured = plan["warmup_steps"], plan["measured_steps"]
    construction = plan.get("construction", "full")

    profiler = None
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        torch.cuda.reset_peak_memory_stats()
    else:
        device = torch.device("cpu")
        profiler = start_cpu_profiler()
    deepspeed.init_distributed()  # zero.Init broadcasts and partitions while the model is built

    init_start = time.perf_counter()
    with torch.profiler.record_function(INIT_MARK):
        with torch.profiler.record_function(BUILD_MARK):
            try:
                model, batch_fn = build_workload(model_spec=plan["model"], checkpointing=plan["checkpointing"],
                                                 sequence_length=plan["sequence_length"], seed=plan["seed"],
                                                 entry_point=plan.get("entry_point"), construction=construction,
                                                 ds_config=config, device=device)
            except Exception as error:
                if classify(error) != "crash":  # an OOM while building is an OOM
                    raise
                raise ModelBuildFailed(f"building the model ({construction} construction, training.model_init) "
                                       f"failed: {type(error).__name__}: {error}") from error
        build_peak = int(torch.cuda.max_memory_allocated()) if cuda else None
        built_partitioned = any(hasattr(p, "ds_id") for p in model.parameters())  # zero.Init's mark
        engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                         if p.requires_grad], config=config)
    if cuda:
        torch.cuda.synchronize()
    init_s = time.perf_counter() - init_start
    init_peaks: dict[str, int | None] = {"init_peak_allocated_bytes": None, "init_peak_reserved_bytes": None}
    if cuda:
        init_peaks = {"init_peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
                      "init_peak_reserved_bytes": int(torch.cuda.max_memory_reserved())}
    losses: list[float] = []
    grad_norms: list[float | None] = []
    step_times: list[float] = []
    peaks: LivePeaks | None = None
    for step in range(warmup + measured):
        if step == warmup and profiler is not None:
            peaks = stop_cpu_profiler(profiler, ranges=(BUILD_MARK, INIT_MARK))
            profiler = None
        batches = _step_batches(batch_fn, step=step, rank=rank, micro=micro, accumulation=accumulation,
                                device=engine.device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        manual_norm = None
        for micro_index, batch in enumerate(batches):
            loss = engine(batch)
            engine.backward(loss)
            if micro_index == accumulation - 1 and engine.zero_optimization_stage() == 0:
                manual_norm = _grad_norm(engine.module)  # stage 0: reduced grads are on the parameters
            engine.step()
            total += loss.detach().double()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        dist.all_reduce(total)
        mean_loss = float(total) / (accumulation * world)
        norm = engine.get_global_grad_norm()
        norm = manual_norm if norm is None else float(norm)
        losses.append(mean_loss)
        grad_norms.append(norm)
        if step >= warmup:
            step_times.append(elapsed)
        if not math.isfinite(mean_loss) or (norm is not None and not math.isfinite(norm)):
            raise NonFiniteLoss(f"step {step}: loss {mean_loss}, grad norm {norm}")
    if profiler is not None:  # no measured steps: the peak covers everything run
        peaks = stop_cpu_profiler(profiler, ranges=(BUILD_MARK, INIT_MARK))
    result: dict[str, Any] = {
        "rank": rank,
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),  # torchrun's agent (node) rank
        "host": socket.gethostname(),
        "status": "ok",
        "device": "cuda" if cuda else "cpu",
        "construction": construction,
        "built_partitioned": built_partitioned,
        "losses": losses,
        "grad_norms": grad_norms,
        "step_times_s": step_times,
        "init_s": init_s,
        "peak_rss_bytes": _peak_rss_bytes(),
        **init_peaks,
    }
    if cuda:
        result["peak_allocated_bytes"] = max(int(torch.cuda.max_memory_allocated()),
                                             init_peaks["init_peak_allocated_bytes"] or 0)
        result["peak_reserved_bytes"] = max(int(torch.cuda.max_memory_reserved()),
                                            init_peaks["init_peak_reserved_bytes"] or 0)
    else:
        assert peaks is not None
        result["peak_allocated_bytes"] = peaks.peak
        result["init_peak_allocated_bytes"] = peaks.until[INIT_MARK]
        build_peak = peaks.until[BUILD_MARK]
        result["peak_reserved_bytes"] = None
    result["build_peak_allocated_bytes"] = build_peak
    engine.destroy()
    return result


def main() -> int:
    die_with_parent(signal.SIGKILL)  # torchrun SIGKILLed: its ranks go too (launchers/orphan_guard.py)
    plan = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = run(plan, out_dir, rank)
        code = 0
    except BaseException as error:  # every failure is data: classify, record, exit non-zero
        result = {"rank": rank, "status": classify(error), "error_type": type(error).__name__,
                  "message": str(error)[-2000:], "traceback": traceback.format_exc()[-4000:]}
        code = 1
    tmp = out_dir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(out_dir / f"rank{rank}.json")  # a rank killed mid-write leaves no half report
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
