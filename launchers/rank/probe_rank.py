"""``python -m launchers.rank.probe_rank PLAN.json OUT_DIR``: one rank of a probe — the machine's kernels timed at the
study's shapes (:mod:`optimizer.perf.probe_plan` says what, :mod:`launchers.probe.machine` starts the ranks and
merges what they write).

Every rank times the same operations at the same moment, as training runs them: the node's ranks share its cores, memory
bandwidth and links (on CPU ranks each rank gets ``OMP_NUM_THREADS = cores / ranks``, as a trial's do). Each operation
runs once to warm up, then ``ROUNDS`` rounds; a round repeats it until it has run at least ``ROUND_S`` (the count fixed
by the warm-up, and for collectives agreed by all ranks — rank 0's — so that none waits on a call the others never make;
a GEMM figure's shapes share one ``ROUND_S``). A CUDA round is timed with CUDA events around the repetitions, a CPU
round with ``time.perf_counter``. The collectives go through ``deepspeed.comm`` — DeepSpeed's own backend choice, as the
engine's collectives do (gloo, or its shared-memory all-reduce on CPU ranks; NCCL on GPUs). Last, DeepSpeed's engine
itself at each ZeRO stage of the space (the other precisions at fewer, ``engine_other_stages``), on the study's model at
a tiny width (:mod:`launchers.rank.probe_engine`), after the study's model's own forward and backward at its width
(:mod:`launchers.rank.probe_pass`). Rank k writes ``rank<k>.json`` (``probe_rank<k>.json`` where the probe ends a
trial's launch, :func:`after_trial`): per figure its kind, precision, micro-batch, variant, work and seconds per run of
each round; an operation the machine cannot run is written as skipped with the reason, never a crash of the probe.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROUNDS = 3
"""Timed rounds per operation and rank (the figure: the slowest rank's median)."""
ENGINE_ROUNDS = ROUNDS
"""Timed rounds of each engine: each a micro-step that accumulates and one that steps, real micro-steps of
DeepSpeed's engine (ZeRO-3's 0.1 s on CPU ranks), where a kernel's round is 10 ms."""
ROUND_S = 0.01
"""Least seconds a round runs (its repetitions are counted off one warm-up run)."""
MAX_REPEATS = 10_000
"""Most repetitions of one operation in a round."""
MAX_TENSOR_BYTES = 1 << 30
"""Most bytes one timed operation's tensors may hold: a wide micro-batch of a large-vocabulary head (Llama-3's
128,256 × 8 × 4,096 tokens in bf16: 8.4 GB of logits) is timed on fewer rows and scaled (:func:`timed_share`), so
that the probe fits beside nothing on the smallest card it plans for."""


def dtype_of(precision: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


class Timer:
    """Rounds of one operation on this rank's device (module doc)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"

    def once(self, op: Callable[[], object], repeats: int) -> float:
        """Seconds of ``repeats`` runs of ``op`` in a row."""
        if self.cuda:
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                op()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        for _ in range(repeats):
            op()
        return time.perf_counter() - begin

    def repeats_for(self, op: Callable[[], object], *, round_s: float = ROUND_S) -> int:
        """Repetitions that make a round last ``round_s`` (one warm-up run, then one timed)."""
        op()
        one = max(self.once(op, 1), 1e-7)
        return max(1, min(MAX_REPEATS, math.ceil(round_s / one)))

    def rounds(self, op: Callable[[], object], *, repeats: int | None = None,
               round_s: float = ROUND_S) -> list[float]:
        """Seconds per run of ``op`` in each of :data:`ROUNDS` rounds of at least ``round_s``."""
        repeats = repeats or self.repeats_for(op, round_s=round_s)
        return [self.once(op, repeats) / repeats for _ in range(ROUNDS)]


def gemm_rounds(timer: Timer, plan: dict[str, Any], *, device: Any, precision: str, micro_batch: int) -> list[float]:
    """Per round: Σ over the model's weight shapes of count × (forward X·Wᵀ + input gradient dY·W + weight gradient
    dYᵀ·X) at T = micro-batch × rows × s tokens (:mod:`optimizer.perf.probe_plan`). One figure's round is one
    :data:`ROUND_S` shared by its shapes (each shape's rounds last ``ROUND_S / shapes``): the sum's noise is that of
    one round's time, and a model of five shapes costs the probe one figure's time, not five."""
    torch = timer.torch
    dtype = dtype_of(precision)
    tokens = micro_batch * plan["rows_per_sample"] * plan["sequence_length"]
    total = [0.0] * ROUNDS
    round_s = ROUND_S / max(1, len(plan["gemm_shapes"]))
    for fan_in, fan_out, count in plan["gemm_shapes"]:
        timed = timed_share(tokens, row_bytes=(2 * fan_in + 2 * fan_out) * dtype.itemsize)
        x = torch.randn(timed, fan_in, device=device, dtype=dtype)
        w = torch.randn(fan_out, fan_in, device=device, dtype=dtype)
        dy = torch.randn(timed, fan_out, device=device, dtype=dtype)

        def trio(x: Any = x, w: Any = w, dy: Any = dy) -> None:
            torch.matmul(x, w.t())
            torch.matmul(dy, w)
            torch.matmul(dy.t(), x)

        for index, seconds in enumerate(timer.rounds(trio, round_s=round_s)):
            total[index] += count * seconds * tokens / timed
    return total


def timed_share(rows: int, *, row_bytes: int) -> int:
    """How many of ``rows`` rows to time so that the operation's tensors stay under :data:`MAX_TENSOR_BYTES` (the
    time is scaled back by rows / timed: at these sizes a GEMM's time is linear in its rows)."""
    return max(1, min(rows, MAX_TENSOR_BYTES // max(1, row_bytes)))


def attention_rounds(timer: Timer, plan: dict[str, Any], *, device: Any, precision: str,
                     micro_batch: int) -> list[float]:
    """Per round: ``layers`` × one causal attention core, softmax(QKᵀ/√d)·V, forward and backward, as the model
    runs it: eager (two matmuls, a masked softmax) or ``scaled_dot_product_attention``."""
    torch = timer.torch
    heads, _, head_dim, layers = plan["attention"]
    rows, s = micro_batch * plan["rows_per_sample"], plan["sequence_length"]
    dtype = dtype_of(precision)
    scores = 3 * heads * s * s if plan["eager_attention"] else 0  # the scores, their softmax, its gradient
    timed = timed_share(rows, row_bytes=(5 * heads * s * head_dim + scores) * dtype.itemsize)
    q, k, v = (torch.randn(timed, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.ones(timed, heads, s, head_dim, device=device, dtype=dtype)

    mask = torch.ones(s, s, device=device, dtype=torch.bool).tril()
    scale = head_dim ** -0.5

    def core() -> None:
        if plan["eager_attention"]:
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale
            out = torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), v)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    return [layers * seconds * rows / timed for seconds in timer.rounds(core)]


def adam_rounds(timer: Timer, *, elements: int, device: Any, host: bool) -> list[float]:
    """One Adam step over ``elements`` fp32 parameters: torch's on the device (fused on CUDA, foreach on CPU), or
    DeepSpeedCPUAdam on the host (``host``; the op the study's offloaded candidates step with)."""
    torch = timer.torch
    param = torch.nn.Parameter(torch.zeros(elements, device="cpu" if host else device))
    param.grad = torch.full_like(param, 1e-3)
    if host:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam([param], lr=1e-4)
    else:
        cuda = param.device.type == "cuda"
        optimizer = torch.optim.Adam([param], lr=1e-4, fused=cuda or None, foreach=None if cuda else True)
    return timer.rounds(optimizer.step)


def copy_rounds(timer: Timer, *, size: int, device: Any, pinned: bool, to_device: bool) -> list[float]:
    """One copy of ``size`` bytes host→device (``to_device``) or back; on CPU ranks host memory to host memory."""
    torch = timer.torch
    host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned and device.type == "cuda")
    there = torch.empty(size, dtype=torch.uint8, device=device)
    if to_device:
        return timer.rounds(lambda: there.copy_(host, non_blocking=pinned))
    return timer.rounds(lambda: host.copy_(there, non_blocking=pinned))


def nvme_rounds(folder: Path, *, size: int, write: bool) -> list[float]:
    """Seconds to write ``size`` bytes to a file in ``folder`` and fsync it, or to read it back with the page cache
    told to drop it first (``posix_fadvise(DONTNEED)``), per round."""
    data = os.urandom(1 << 20) * max(1, size // (1 << 20))
    fd, name = tempfile.mkstemp(dir=folder, prefix=".dsopt-probe-")
    seconds = []
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        for _ in range(ROUNDS):
            if write:
                begin = time.perf_counter()
                with open(name, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
            else:
                with open(name, "rb") as src:
                    os.posix_fadvise(src.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                    begin = time.perf_counter()
                    while src.read(1 << 24):
                        pass
            seconds.append(time.perf_counter() - begin)
    finally:
        Path(name).unlink(missing_ok=True)
    return seconds


def collective_rounds(timer: Timer, *, kind: str, size: int, device: Any, ranks: int) -> list[float]:
    """One ``all_reduce``, ``reduce_scatter`` or ``all_gather`` of a ``size``-byte buffer (the gathered result's
    size) through ``deepspeed.comm``; every rank runs rank 0's repetition count."""
    import deepspeed.comm as dist

    torch = timer.torch
    elements = max(ranks, size // 4 // ranks * ranks)
    whole = torch.ones(elements, device=device)
    part = torch.ones(elements // ranks, device=device)
    op = {"all_reduce": lambda: dist.all_reduce(whole),
          "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole),
          "all_gather": lambda: dist.all_gather_into_tensor(whole, part)}[kind]
    count = torch.tensor([timer.repeats_for(op)], device=device)
    dist.broadcast(count, src=0)
    return timer.rounds(op, repeats=int(count.item()))


def run(plan: dict[str, Any], *, begin: float | None = None) -> dict[str, Any]:
    """Every operation of ``plan`` on this rank (module doc); the rank's report, its ``seconds`` counted from
    ``begin`` (``time.perf_counter``; by default from the process group's start).

    The probe runs with CPython's automatic collection off and the heap it finds (torch, DeepSpeed,
    ``transformers``: millions of objects) frozen (``gc.freeze``); both are restored at its end. A model pass or an
    engine, once timed, is freed by one collection that walks only what the probe made since the last freeze, and what
    survives it (the modules its build imported: bitsandbytes, sympy) is frozen in turn
    (:func:`launchers.measure.gc_pauses.settle_heap`). So no collection falls into a timed round, and none walks the
    old heap: a full one costs ~0.1 s on this project's 2-core Xeon (:mod:`launchers.measure.gc_pauses`), and with
    the heap frozen but collection on, CPython's full collections came every ~0.7 s, each walking the growing young
    heap (11 → 92 ms, into the engines' rounds: a QLoRA probe's ZeRO-0 micro-step read 21 ms against 13)."""
    enabled = gc.isenabled()
    gc.disable()
    gc.freeze()
    try:
        return probe_all(plan, begin=begin)
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def probe_all(plan: dict[str, Any], *, begin: float | None) -> dict[str, Any]:
    """:func:`run`'s operations, the heap frozen."""
    import deepspeed.comm as dist
    import torch

    from launchers.rank.probe_engine import engines_timed
    from launchers.rank.probe_pass import pass_figures, skip_reason

    cuda = plan["accelerator"] == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    timer, figures, skipped = Timer(device), [], []
    begin = time.perf_counter() if begin is None else begin

    def measure(what: dict[str, Any], rounds: Callable[[], list[float]]) -> None:
        dist.barrier()
        try:
            figures.append({**what, "rounds_s": rounds()})
        except Exception as err:  # an operation this machine cannot run is a finding, not a crash
            skipped.append({"what": " ".join(str(v) for v in what.values() if v), "why": skip_reason(err)})

    for precision in plan["precisions"]:
        for micro_batch in plan["micro_batches"]:
            tag = {"precision": precision, "micro_batch": micro_batch}
            measure({"kind": "gemm", **tag, "work": plan["gemm_flops"][str(micro_batch)]},
                    lambda t=tag: gemm_rounds(timer, plan, device=device, **t))
            measure({"kind": "attention", **tag, "work": plan["attention_flops"][str(micro_batch)]},
                    lambda t=tag: attention_rounds(timer, plan, device=device, **t))
    if plan["device_adam_elements"]:
        measure({"kind": "device_adam", "work": plan["device_adam_elements"]},
                lambda: adam_rounds(timer, elements=plan["device_adam_elements"], device=device, host=False))
    if plan["host_adam_elements"]:
        measure({"kind": "host_adam", "work": plan["host_adam_elements"]},
                lambda: adam_rounds(timer, elements=plan["host_adam_elements"], device=device, host=True))
    for pinned in ((True, False) if cuda else (False,)):
        for to_device in ((True, False) if cuda else (True,)):
            if plan["copy_bytes"]:
                variant = f"{'pinned' if pinned else 'pageable'} {'h2d' if to_device else 'd2h'}" if cuda else "host"
                measure({"kind": "copy", "variant": variant, "work": plan["copy_bytes"]},
                        lambda p=pinned, d=to_device: copy_rounds(timer, size=plan["copy_bytes"], device=device,
                                                                  pinned=p, to_device=d))
    if plan["memory_bytes"]:
        source = torch.empty(plan["memory_bytes"], dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        measure({"kind": "memory", "work": 2 * plan["memory_bytes"]},
                lambda: timer.rounds(lambda: target.copy_(source)))
    ranks = dist.get_world_size()
    if ranks > 1:
        for kind, sizes in (("all_reduce", plan["reduce_bytes"]), ("reduce_scatter", plan["scatter_bytes"])):
            for size in sizes:
                measure({"kind": kind, "variant": f"{size} B", "work": size},
                        lambda k=kind, s=size: collective_rounds(timer, kind=k, size=s, device=device, ranks=ranks))
        for size in plan["gather_bytes"]:
            measure({"kind": "all_gather", "variant": f"{size} B", "work": size},
                    lambda s=size: collective_rounds(timer, kind="all_gather", size=s, device=device, ranks=ranks))
    if plan["nvme_path"] and local == 0:  # one writer per node: the ranks share its NVMe
        for write in (True, False):
            kind = "nvme_write" if write else "nvme_read"
            try:
                figures.append({"kind": kind, "work": plan["nvme_bytes"],
                                "rounds_s": nvme_rounds(Path(plan["nvme_path"]), size=plan["nvme_bytes"],
                                                        write=write)})
            except OSError as err:
                skipped.append({"what": kind, "why": f"{plan['nvme_path']}: {err.strerror or err}"})
    for model_pass in plan.get("passes", ()):  # the model's own forward and backward (launchers/rank/probe_pass.py)
        dist.barrier()
        try:
            timed, missed = pass_figures(timer.rounds, model_pass, device=device)
            figures += timed
            skipped += missed
        except Exception as err:  # a model that cannot be built here is a finding: the GEMM figures stand alone
            skipped.append({"what": f"model pass {model_pass['precision']}", "why": skip_reason(err)})
    engine_figures, engine_skipped = engines_timed(timer.once, plan.get("engines", ()), rounds=ENGINE_ROUNDS,
                                                   precision=plan.get("engine_precision", ""), device=device)
    figures += engine_figures
    skipped += engine_skipped
    dist.barrier()
    return {"rank": dist.get_rank(), "seconds": time.perf_counter() - begin, "figures": figures, "skipped": skipped}


def write_report(report: dict[str, Any], path: Path) -> None:
    """``report`` at ``path``, written atomically: a rank killed mid-write leaves no half report."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report))
    tmp.replace(path)


def after_trial(plan: dict[str, Any], out_dir: Path) -> None:
    """The probe within a trial's launch, once the trial's own report is written and its engine freed: the FP32
    reference's launch carries it where the study has no probe yet (:mod:`launchers.study.study_run`), so that
    the probe pays no launch, imports or process group of its own. Writes ``probe_rank<k>.json``; a failure is
    written there as the probe's, and the rank exits at once (non-zero, so that torchrun ends a peer waiting in a
    collective): the trial's report stands (:func:`launchers.trial.run.run_trial` keeps it)."""
    import torch

    begin = time.perf_counter()  # the probe's clock counts the collection that frees the trial (~0.1 s on CPU ranks)
    gc.collect()
    if torch.cuda.is_available() and plan["accelerator"] == "cuda":
        torch.cuda.empty_cache()
    rank = int(os.environ.get("RANK", "0"))
    try:
        report = run(plan, begin=begin)
    except Exception as err:  # the trial stands; the study probes again on its own launch
        write_report({"rank": rank, "error": f"{type(err).__name__}: {str(err)[:500]}"},
                     out_dir / f"probe_rank{rank}.json")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # at once, no barrier: a peer may wait in a collective this rank never joins; torchrun ends it
    write_report(report, out_dir / f"probe_rank{rank}.json")


def main(argv: list[str]) -> int:
    plan_path, out_dir = Path(argv[0]), Path(argv[1])
    import signal

    import torch.distributed

    from launchers.process.cpu_info import install as keep_cpu_info
    from launchers.process.lazy_compile import install as compile_muon_lazily
    from launchers.process.orphan_guard import die_with_parent

    die_with_parent(signal.SIGKILL)  # torchrun SIGKILLed: its ranks go too (launchers/process/orphan_guard.py)
    keep_cpu_info()  # DeepSpeed's op loads ask py-cpuinfo; once per node (launchers/process/cpu_info.py)
    compile_muon_lazily()  # DeepSpeed's Muon kernels: compiled if ever called (launchers/process/lazy_compile.py)
    report = run(json.loads(plan_path.read_text()))
    write_report(report, out_dir / f"rank{report['rank']}.json")
    if torch.distributed.is_initialized():  # as a trial's ranks end: every rank here, then the group torn down
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    from launchers.process.collector import end_rank

    end_rank(main(sys.argv[1:]))  # no interpreter teardown after the report (launchers/process/collector.py)
