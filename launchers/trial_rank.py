"""The per-rank trial program: one short real DeepSpeed run, measured, then a clean teardown.

Started by :mod:`launchers.local` under ``torch.distributed.run`` (one process per rank) as
``python -m launchers.trial_rank PLAN.json OUT_DIR``. It writes ``OUT_DIR/rank<r>.json``:

* on success: peak memory (CUDA: ``max_memory_allocated`` and ``max_memory_reserved``; CPU ranks: the
  peak of live tensor bytes from the PyTorch profiler's allocation events (:mod:`launchers.cpu_memory`),
  recorded from before the model is built through the warm-up steps, and the process's peak RSS),
  per-step wall time of the measured steps, tokens/s, the loss of every step (mean over ranks and
  micro-batches), the gradient norm;
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

from launchers.cpu_memory import live_tensor_peak, start_cpu_profiler
from launchers.orphan_guard import die_with_parent
from launchers.workload import build_workload

UNSUPPORTED_MARK = "is not supported on your device"
"""DeepSpeed engine.py: ``raise ValueError("Type fp16 is not supported on your device.")``."""
CPU_OOM_MARK = "DefaultCPUAllocator: can't allocate memory"


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


def run(plan: dict[str, Any], out_dir: Path, rank: int) -> dict[str, Any]:
    import deepspeed

    world = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    config = plan["config"]
    micro, accumulation = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    per_rank = micro * accumulation
    warmup, measured = plan["warmup_steps"], plan["measured_steps"]

    profiler = None
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.reset_peak_memory_stats()
    else:
        profiler = start_cpu_profiler()

    model, batch_fn = build_workload(model_spec=plan["model"], checkpointing=plan["checkpointing"],
                                     sequence_length=plan["sequence_length"], seed=plan["seed"],
                                     entry_point=plan.get("entry_point"))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                     if p.requires_grad], config=config)
    losses: list[float] = []
    grad_norms: list[float | None] = []
    step_times: list[float] = []
    peak_tensor_bytes: int | None = None
    for step in range(warmup + measured):
        if step == warmup and profiler is not None:
            profiler.stop()
            peak_tensor_bytes, _ = live_tensor_peak(profiler)
            profiler = None
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        manual_norm = None
        for micro_index in range(accumulation):
            first = rank * per_rank + micro_index * micro
            batch = batch_fn(step, list(range(first, first + micro)))
            batch = batch.to(engine.device) if isinstance(batch, torch.Tensor) else batch
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
        profiler.stop()
        peak_tensor_bytes, _ = live_tensor_peak(profiler)
    result: dict[str, Any] = {
        "rank": rank,
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),  # torchrun's agent (node) rank
        "host": socket.gethostname(),
        "status": "ok",
        "device": "cuda" if cuda else "cpu",
        "losses": losses,
        "grad_norms": grad_norms,
        "step_times_s": step_times,
        "peak_rss_bytes": _peak_rss_bytes(),
    }
    if cuda:
        result["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        result["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    else:
        result["peak_allocated_bytes"] = peak_tensor_bytes
        result["peak_reserved_bytes"] = None
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
