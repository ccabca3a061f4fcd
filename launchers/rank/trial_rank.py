"""The per-rank trial program: one short real DeepSpeed run, measured, then a clean teardown.

Started by :mod:`launchers.trial.local` under ``torch.distributed.run`` (one process per rank) as
``python -m launchers.rank.trial_rank PLAN.json OUT_DIR``. It writes ``OUT_DIR/rank<r>.json``:

* on success: peak memory (CUDA: ``max_memory_allocated`` and ``max_memory_reserved``; CPU ranks: the
  peak of live tensor bytes from the PyTorch profiler's allocation events (:mod:`launchers.measure.cpu_memory`),
  recorded from before the model is built through the warm-up steps, and the process's peak RSS) over the
  whole run, over the init phase alone (construction + ``deepspeed.initialize``, ``init_peak_*``) and over
  training alone (``training_peak_*``: CUDA's statistics are reset once init is over; CPU ranks: the events
  after the init range), the init time (``init_s``), per-step wall time of the measured steps — each step's
  batches are built before its clock starts — the loss of every attempted step (mean over ranks and
  micro-batches), the gradient norm, whether the step was applied and the fp16 loss scale after it
  (:mod:`optimizer.results.loss_scaling`: an overflowed step is skipped, its batch replayed, and not timed).
  The model is built as ``plan["construction"]`` says (:mod:`launchers.models.construction`). CUDA ranks also report
  the device use the driver sees at those check points (:mod:`launchers.measure.device_memory`; None on CPU ranks);
* stopped over the budget (``plan["stop_above"]``, :class:`~optimizer.results.trial_result.StopAbove`): status
  ``over_budget``, the same report with what was measured until then (peaks as far as known, the losses and
  step times so far, ``init_s``), ``stopped_at`` (``"init"`` or ``"step N"``, N the 0-based attempted step after
  which the ranks stopped) and ``over_limit`` (this rank's own peak over its limit: phase, peak and limit bytes;
  None on a rank that stopped with a peer). CUDA checks the init phase's reserved peak once
  ``deepspeed.initialize`` is done and ``max_memory_reserved`` after every attempted step; CPU ranks know their
  live-tensor peaks only when the profiler stops, at the end of the warm-up, and check both there (so a CPU run
  stopped at ``"init"`` has run its warm-up). Every check point is a collective (MAX of the ranks' verdicts):
  the ranks stop together, then tear down as a run that ended does;
* on failure: the failure kind, classified from the exception itself (:func:`classify`) — ``oom`` (the
  device's memory: ``torch.OutOfMemoryError``, CUDA/cuBLAS/NCCL allocation failures; on CPU ranks the host's),
  ``oom_host`` (host memory on CUDA ranks: pinning, ``MemoryError``, ENOMEM), ``unsupported`` (DeepSpeed's
  ``ValueError("Type fp16 is not supported on your device.")``), ``nan`` (a non-finite loss or gradient
  norm, an fp16 loss scale collapsed to its minimum) — or ``crash`` for anything else, with the exception's text.
"""

from __future__ import annotations

import errno
import json
import os
import re
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

from launchers.measure.cpu_memory import LivePeaks, start_cpu_profiler, stop_cpu_profiler
from launchers.measure.device_identity import cuda_rank, device_identity
from launchers.measure.device_memory import DeviceMemory
from launchers.measure.gc_pauses import GcPauses
from launchers.measure.rng_draws import DrawWatch
from launchers.models.builtin import build_workload
from launchers.models.reference import anchored, reference_engine, reference_forward
from launchers.process.collector import end_rank
from launchers.process.cpu_info import install as keep_cpu_info
from launchers.process.lazy_compile import install as compile_muon_lazily
from launchers.process.orphan_guard import die_with_parent
from launchers.rank.probe_rank import after_trial, write_report
from optimizer.results.loss_scaling import StepKind, min_loss_scale, skip_allowance, step_kind
from optimizer.results.trial_result import INIT_STOP, OVER_BUDGET, StopAbove

UNSUPPORTED_MARK = "is not supported on your device"
"""DeepSpeed engine.py: ``raise ValueError("Type fp16 is not supported on your device.")``."""
CPU_OOM_MARK = "DefaultCPUAllocator: can't allocate memory"
"""c10/core/impl/alloc_cpu.cpp: ``"DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes. Error
code 12 (Cannot allocate memory)"`` — host memory."""
HOST_OOM_MARKS = (
    CPU_OOM_MARK,
    # strerror(ENOMEM): a failed mmap / mlock / posix_memalign — pinning host memory (DeepSpeed's pinned
    # offload buffers, its AIO buffers), NCCL's SYSCHECK ("Call to <fn> failed: Cannot allocate memory",
    # NCCL src/include/checks.h)
    "Cannot allocate memory",
    "Failed to malloc",  # NCCL src/include/alloc.h ncclCalloc / ncclRealloc (ncclSystemError)
    "Failed to CUDA host alloc",  # NCCL src/include/alloc.h ncclCudaHostCalloc: its pinned host buffers
)
"""Texts of host-allocation failures (checked before the device's: NCCL's last error names the host alloc)."""
DEVICE_OOM_MARKS = (
    # c10/cuda/CUDACachingAllocator.cpp's OutOfMemoryError text, where a library re-raises it as a plain
    # RuntimeError (TorchScript does: pytorch/pytorch#148642)
    "CUDA out of memory",
    # c10/cuda/CUDAException.cpp c10_cuda_check_implementation: "CUDA error: " + cudaGetErrorString(
    # cudaErrorMemoryAllocation) — a RuntimeError before torch.AcceleratorError (torch 2.8)
    "CUDA error: out of memory",
    "CUDA driver error: out of memory",  # c10/cuda/driver_api.h C10_CUDA_DRIVER_CHECK (CUDA_ERROR_OUT_OF_MEMORY)
    "cudaErrorMemoryAllocation",  # cudaGetErrorName of the same code (libraries that print the name)
    # ATen/cuda/Exceptions.h TORCH_CUDABLAS_CHECK: "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling
    # `cublasCreate(handle)`" — cuBLAS's cublasStatus_t for a failed handle/workspace allocation
    "CUBLAS_STATUS_ALLOC_FAILED",
)
"""Texts of device-allocation failures."""
NCCL_CUDA_OOM = re.compile(r"Cuda failure (?:\d+ )?'out of memory'")
"""NCCL's last error after a failed CUDA allocation — src/include/checks.h CUDACHECK ``"Cuda failure '%s'"`` (runtime
API), src/include/cudawrap.h CUCHECK ``"Cuda failure %d '%s'"`` (driver API) — which torch appends to its
``DistBackendError`` ("NCCL error in: ..., unhandled cuda error ... ncclUnhandledCudaError: Call to CUDA function
failed.\nLast error:\n...", torch/csrc/distributed/c10d/NCCLUtils getNcclErrorDetailStr)."""
CUDA_ERROR_MEMORY_ALLOCATION = 2
"""``cudaErrorMemoryAllocation`` (CUDA runtime driver_types.h): ``torch.AcceleratorError.error_code`` of an
allocation that ``C10_CUDA_CHECK`` saw fail (torch/csrc/Exceptions.cpp _new_accelerator_error_object)."""
PINNING = "pin_memory"
"""Where a CUDA allocation failure is a host one: raised by ``pin_memory`` (cudaHostAlloc; DeepSpeed
accelerator/cuda_accelerator.py ``pin_memory`` → ``tensor.pin_memory()``) or ``torch.empty(..., pin_memory=True)``."""
MIN_SCALE_MARK = "loss scale already at minimum"
"""DeepSpeed runtime/fp16/loss_scaler.py:257-259: an overflow with the dynamic loss scale at its minimum."""
INIT_MARK = "dsopt.init"
"""The profiler range around model construction and ``deepspeed.initialize``: the init phase."""
BUILD_MARK = "dsopt.build"
"""The profiler range around model construction alone."""

STOP_CODES = {"training": 1, "init": 2}
"""A rank's verdict at a check point, all-reduced with MAX: 0 go on, 1 training over its limit, 2 the init phase."""


class ModelBuildFailed(RuntimeError):
    """The model could not be built the way the construction says (e.g. an entry point that refuses zero.Init)."""


class NonFiniteLoss(RuntimeError):
    """A loss or gradient norm that is NaN or infinite."""


def _raised_while_pinning(error: BaseException) -> bool:
    """The innermost Python frame of ``error`` was pinning host memory (:data:`PINNING`)."""
    frames = traceback.extract_tb(error.__traceback__)
    line = frames[-1].line or "" if frames else ""
    return bool(frames) and (frames[-1].name == PINNING or f".{PINNING}(" in line or f"{PINNING}=True" in line)


def classify(error: BaseException, *, cpu_ranks: bool | None = None) -> str:
    """The failure kind of an exception raised inside the trial: by its type first, its text second, then the
    exception it was raised from.

    ``oom`` is the device's memory; a host allocation that failed is ``oom_host`` on CUDA ranks and ``oom`` on CPU
    ranks (``cpu_ranks``, default: as :func:`run` decides), whose device memory is the host's.
    """
    cpu_ranks = not cuda_rank() if cpu_ranks is None else cpu_ranks
    host = "oom" if cpu_ranks else "oom_host"
    if isinstance(error, NonFiniteLoss):
        return "nan"
    if isinstance(error, torch.OutOfMemoryError):  # the device caching allocator's (torch.cuda.OutOfMemoryError)
        return "oom"
    if isinstance(error, MemoryError) or (isinstance(error, OSError) and error.errno == errno.ENOMEM):
        return host
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    device = accelerator_error is not None and isinstance(error, accelerator_error) \
        and getattr(error, "error_code", None) == CUDA_ERROR_MEMORY_ALLOCATION
    if isinstance(error, RuntimeError) and not device:
        text = str(error)
        if any(mark in text for mark in HOST_OOM_MARKS):
            return host
        device = any(mark in text for mark in DEVICE_OOM_MARKS) or NCCL_CUDA_OOM.search(text) is not None
    if device:
        return host if _raised_while_pinning(error) else "oom"
    if isinstance(error, ValueError) and UNSUPPORTED_MARK in str(error):
        return "unsupported"
    if error.__cause__ is not None and error.__cause__ is not error:  # raise ... from <the real failure>
        return classify(error.__cause__, cpu_ranks=cpu_ranks)
    return "crash"


def _reports_grad_norm(engine: Any) -> bool:
    """Whether DeepSpeed gives the step's gradient norm: the engine copies it from an optimizer that keeps one
    (engine.py:3518-3519 ``if hasattr(self.optimizer, '_global_grad_norm')`` — the ZeRO, FP16 and BF16
    optimizers); a plain optimizer at stage 0 in fp32 keeps none."""
    return hasattr(engine.optimizer, "_global_grad_norm")


def _grad_norm(module: torch.nn.Module) -> float | None:
    """L2 norm of the parameters' gradients where DeepSpeed reports none (:func:`_reports_grad_norm`: stage 0 in
    fp32): each gradient's norm in its own dtype — a reduction that allocates only its scalar, where ``.double()``
    first materialised a float64 copy of the tensor (197 MB for a 32000×768 embedding, at the peak) — then the norm
    of those norms in float64. The per-tensor reductions accumulate in double on CPU (``acc_type<float>``) and in
    fp32 trees on CUDA: well inside what a sanity check of the norm needs."""
    norms = [torch.linalg.vector_norm(p.grad.detach()) for p in module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms).double())) if norms else None


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _step_batches(batch_fn: Any, *, step: int, rank: int, micro: int, accumulation: int,
                  device: torch.device, sequences: int = 1) -> list[Any]:
    """The step's micro-batches of this rank, built before the step is timed (data is not the workload); sample i's
    rows i·sequences + k stacked as TRL's DPO collator does, all k = 0 first (``dpo_trainer.py:349-352``)."""
    batches = []
    for micro_index in range(accumulation):
        first = (rank * accumulation + micro_index) * micro
        batch = batch_fn(step, [i * sequences + k for k in range(sequences) for i in range(first, first + micro)])
        batches.append(batch.to(device) if isinstance(batch, torch.Tensor) else batch)
    return batches


def _over_limit(stop: StopAbove, *, init_peak: int | None, training_peak: int | None) -> dict[str, Any] | None:
    """This rank's own peak over its limit (the init phase's first), as its report records it, or None."""
    for phase, peak, limit in (("init", init_peak, stop.init_bytes), ("training", training_peak, stop.training_bytes)):
        if peak is not None and peak > limit:
            return {"phase": phase, "peak_bytes": peak, "limit_bytes": limit}
    return None


def _agreed_stop(over: dict[str, Any] | None, *, attempted: int, device: torch.device) -> str | None:
    """Where every rank stops — ``"init"``, or ``"step N"`` after attempted step N — or None to go on: the worst
    of the ranks' verdicts (all_reduce MAX), so that no rank is left alone in a collective."""
    flag = torch.tensor([STOP_CODES[over["phase"]] if over else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    code = int(flag.item())
    return None if code == 0 else INIT_STOP if code == STOP_CODES["init"] else f"step {attempted - 1}"


def _cpu_stop(stop: StopAbove, peaks: LivePeaks, *, attempted: int) -> tuple[dict[str, Any] | None, str | None]:
    """CPU ranks' check, once the profiler has stopped: the init phase's live-tensor peak, and training's over
    the steps run so far (none: no training peak yet)."""
    over = _over_limit(stop, init_peak=peaks.until[INIT_MARK],
                       training_peak=peaks.after[INIT_MARK] if attempted else None)
    return over, _agreed_stop(over, attempted=attempted, device=torch.device("cpu"))


def run(plan: dict[str, Any], out_dir: Path, rank: int) -> dict[str, Any]:
    cuda = cuda_rank()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device_memory = DeviceMemory.open(cuda=cuda, index=local)  # before CUDA is touched: NVML's baseline
    import deepspeed
    compile_muon_lazily()  # DeepSpeed's Muon kernels: compiled if ever called, not imported per engine (its doc)
    world = int(os.environ["WORLD_SIZE"])
    config = plan["config"]
    micro, accumulation = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    warmup, measured = plan["warmup_steps"], plan["measured_steps"]
    construction = plan.get("construction", "full")
    stop = StopAbove.from_plan(plan["stop_above"]) if plan.get("stop_above") else None
    over: dict[str, Any] | None = None  # this rank's own peak over its limit, at the last check
    stopped_at: str | None = None

    profiler = None
    if cuda:
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
        reference = reference_engine(plan, device=device) if plan["model"].get("reference_model") else None
    # Training draws (dropout masks, LoRA dropout) from one state whatever the construction consumed: zero.Init
    # and PEFT's adapter init draw from the global generator, so a candidate and its FP32 reference built
    # otherwise would see different masks.
    torch.manual_seed(plan["seed"] + 1)
    if cuda:
        torch.cuda.synchronize()
    init_s = time.perf_counter() - init_start
    init_peaks: dict[str, int | None] = {"init_peak_allocated_bytes": None, "init_peak_reserved_bytes": None}
    if cuda:
        init_peaks = {"init_peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
                      "init_peak_reserved_bytes": int(torch.cuda.max_memory_reserved())}
        device_memory.sample(init=True)
    if cuda and stop is not None:
        over = _over_limit(stop, init_peak=init_peaks["init_peak_reserved_bytes"], training_peak=None)
        stopped_at = _agreed_stop(over, attempted=0, device=engine.device)
    if cuda:  # from here on the peaks are training's: the init phase's were read above
        torch.cuda.reset_peak_memory_stats()
    fp16 = config.get("fp16") if (config.get("fp16") or {}).get("enabled") else None
    floor = min_loss_scale(fp16)
    losses: list[float] = []
    grad_norms: list[float | None] = []
    applied: list[bool] = []
    loss_scales: list[float | None] = []
    step_times: list[float] = []
    peaks: LivePeaks | None = None
    draws, pauses = DrawWatch(), GcPauses()
    done = 0  # updates applied so far: a skipped (overflowed) step's batch is replayed
    attempts = warmup + measured + skip_allowance(fp16)
    while stopped_at is None and done < warmup + measured and len(losses) < attempts:
        if done == warmup and profiler is not None:
            peaks = stop_cpu_profiler(profiler, ranges=(BUILD_MARK, INIT_MARK))
            profiler = None
            if stop is not None:
                over, stopped_at = _cpu_stop(stop, peaks, attempted=len(losses))
                if stopped_at is not None:
                    break
        if done == warmup and not pauses.watching:  # the warm-up's heap settled, untimed (measure/gc_pauses.py)
            pauses.settle_and_start()
        batches = _step_batches(batch_fn, step=done, rank=rank, micro=micro, accumulation=accumulation,
                                device=engine.device, sequences=int(plan["model"].get("sequences_per_sample", 1)))
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        manual_norm = None
        for micro_index, batch in enumerate(batches):
            draws.before(watch=done < warmup)  # the warm-up's untimed micro-steps only
            loss = engine(batch)
            if plan["model"].get("reference_model"):  # the reference's forward after the policy's, as TRL's
                loss = anchored(loss, reference_forward(policy=engine, reference=reference, batch=batch))
            engine.backward(loss)
            draws.after()
            if micro_index == accumulation - 1 and not _reports_grad_norm(engine):
                manual_norm = _grad_norm(engine.module)  # stage 0 fp32: reduced grads are on the parameters
            try:
                engine.step()
            except Exception as error:  # the dynamic scaler at its minimum (loss_scaler.py:257-259)
                if MIN_SCALE_MARK in str(error):
                    raise NonFiniteLoss(f"step {len(losses)}: fp16 loss scale collapsed: {error}") from error
                raise
            total += loss.detach().double()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        device_memory.sample()  # outside the timed window
        dist.all_reduce(total)
        mean_loss = float(total) / (accumulation * world)
        norm = engine.get_global_grad_norm()
        norm = manual_norm if norm is None else float(norm)
        was_applied = bool(engine.was_step_applied())  # False after an fp16 overflow (engine.py:3534-3541)
        scale = engine._get_optimizer_loss_scale() if fp16 else None  # engine.py:3771-3776
        scale = None if scale is None else float(scale)
        kind = step_kind(loss=mean_loss, grad_norm=norm, applied=was_applied, loss_scale=scale, min_loss_scale=floor)
        losses.append(mean_loss)
        grad_norms.append(norm)
        applied.append(was_applied)
        loss_scales.append(scale)
        if kind is StepKind.NONFINITE:
            raise NonFiniteLoss(f"step {len(losses) - 1}: loss {mean_loss}, grad norm {norm}, applied "
                                f"{was_applied}, loss scale {scale}")
        if kind is StepKind.APPLIED:
            if done >= warmup:
                step_times.append(elapsed)
            done += 1
        if cuda and stop is not None:  # the reserved peak since init, after every attempted step
            over = _over_limit(stop, init_peak=None, training_peak=int(torch.cuda.max_memory_reserved()))
            stopped_at = _agreed_stop(over, attempted=len(losses), device=engine.device)
    if stopped_at is None and done < warmup + measured:
        raise NonFiniteLoss(f"fp16 loss scale never settled: {applied.count(False)} of {len(applied)} steps "
                            f"skipped (allowance {attempts - warmup - measured})")
    if profiler is not None:  # no measured steps: the peak covers everything run
        peaks = stop_cpu_profiler(profiler, ranges=(BUILD_MARK, INIT_MARK))
        if stop is not None:
            over, stopped_at = _cpu_stop(stop, peaks, attempted=len(losses))
    result: dict[str, Any] = {
        "rank": rank,
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),  # torchrun's agent (node) rank
        "host": socket.gethostname(),
        "status": "ok" if stopped_at is None else OVER_BUDGET,
        "stopped_at": stopped_at, "over_limit": over,
        "device": "cuda" if cuda else "cpu",
        **device_identity(cuda=cuda),  # device_name, device_total_bytes: None on CPU ranks
        "construction": construction, "built_partitioned": built_partitioned,
        "losses": losses, "grad_norms": grad_norms, "applied": applied, "loss_scales": loss_scales,
        "step_times_s": step_times, "init_s": init_s, "peak_rss_bytes": _peak_rss_bytes(),
        "gc_pauses": pauses.finish(),  # the measured steps' cyclic collections; the heap thawed
        "draws_random": draws.drew,  # the warm-up's micro-steps drew random numbers (launchers/measure/rng_draws.py)
        **init_peaks,
    }
    if cuda:  # training's peaks since the reset after init (none when stopped there); init's pool is in them
        trained = stopped_at != INIT_STOP
        if trained:
            device_memory.sample()
        result["training_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated()) if trained else None
        result["training_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved()) if trained else None
        result["peak_allocated_bytes"] = max(result["training_peak_allocated_bytes"] or 0,
                                             init_peaks["init_peak_allocated_bytes"] or 0)
        result["peak_reserved_bytes"] = max(result["training_peak_reserved_bytes"] or 0,
                                            init_peaks["init_peak_reserved_bytes"] or 0)
    else:
        assert peaks is not None
        result["peak_allocated_bytes"] = peaks.peak
        result["init_peak_allocated_bytes"] = peaks.until[INIT_MARK]
        result["training_peak_allocated_bytes"] = peaks.after[INIT_MARK]
        result["training_peak_reserved_bytes"] = result["peak_reserved_bytes"] = None  # no pool on CPU ranks
        build_peak = peaks.until[BUILD_MARK]
    result["build_peak_allocated_bytes"] = build_peak
    result.update(device_memory.report())
    engine.destroy()
    return result


def main() -> int:
    die_with_parent(signal.SIGKILL)  # torchrun SIGKILLed: its ranks go too (launchers/process/orphan_guard.py)
    keep_cpu_info()  # DeepSpeed asks py-cpuinfo once per node, not twice per rank (launchers/process/cpu_info.py)
    plan, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    try:
        result, code = run(plan, out_dir, rank), 0
    except BaseException as error:  # every failure is data: classify, record, exit non-zero
        result = {"rank": rank, "status": classify(error), "error_type": type(error).__name__,
                  "message": str(error)[-2000:], "traceback": traceback.format_exc()[-4000:],
                  **device_identity(cuda=cuda_rank())}
        code = 1
    write_report(result, out_dir / f"rank{rank}.json")
    if code == 0 and plan.get("probe"):  # the machine's probe in the FP32 reference's launch (probe_rank.after_trial)
        after_trial(plan["probe"], out_dir)
    if dist.is_initialized():
        if code == 0:  # ok, or stopped over the budget: every rank is here, none in a collective
            dist.barrier()
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    end_rank(main())  # no interpreter teardown after the report (launchers/process/collector.py)
