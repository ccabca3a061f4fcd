"""Rank program for test_offload_norms_real.py: where DeepSpeed takes the gradient norm with the optimizer on the
host, what that allocates, and how many gradient elements a ZeRO-1/2 rank keeps.

Run under ``torchrun --nproc_per_node 2`` with ``DS_ACCELERATOR=cpu``. Arguments: a JSON file of cases ({name,
model (launchers.trial.run.model_dict), config (DeepSpeed JSON), seq}) and an output folder. Each case builds the
built-in GPT as trials do and trains two optimizer steps (``gradient_accumulation_steps`` micro-batches each,
``engine.step()`` after every one as a training loop does); the second (the first makes Adam's states) runs under
the PyTorch profiler with c10's all-thread allocation counter (launchers/measure/cpu_memory.py). DeepSpeed
0.19.8's per-parameter norm method is wrapped in a ``record_function`` range on the optimizer instance:

* ZeRO-3: ``_offload_grad_partition_at_boundary`` (stage3.py:1443-1457: the fp64 norm of the partition, then its
  fp32 copy to the host);
* ZeRO-1/2: ``set_norm_for_param_grad_in_gpu`` (stage_1_and_2.py:1873-1886: the fp64 norm of the rank's piece).

Written per rank to ``<out>/<case>.rank<r>.json``: the norm calls per phase (``backward``: inside
``engine.backward``; ``step``: inside ``engine.step``); ``norm_transient``, the largest transient of one call (peak
live bytes inside its range minus the live bytes before its first allocation event); ``step_transient``, the same
for ``engine.step`` up to ZeRO-1/2's all-gather of the updated parameters (``all_gather_dp_groups``,
stage_1_and_2.py:3155, wrapped in that module: gloo's output tensor is the ledger's ``gather`` phase); and the
element counts of ``grads_in_partition`` (stage_1_and_2.py:2184-2194, read after each copy into it: DeepSpeed drops
its own reference after every backward, :930) and of ``accumulated_grads_in_cpu`` (:1824, 1853).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.runtime.zero.stage_1_and_2 as zero12
import torch
from torch._C._profiler import _EventType

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from launchers.measure.cpu_memory import CpuProfiler, count_every_thread, start_cpu_profiler
from launchers.models.builtin import build_workload
from launchers.process.collector import end_rank

NORM = "dsopt.norm"
STEP = "dsopt.step"
GATHER = "dsopt.gather"
STEPS = 2
NORM_METHODS = {1: "set_norm_for_param_grad_in_gpu", 2: "set_norm_for_param_grad_in_gpu",
                3: "_offload_grad_partition_at_boundary"}


def ranged(function: Callable, label: str, on_call: Callable[[], None] = lambda: None) -> Callable:
    """``function`` inside a ``record_function(label)`` range, ``on_call`` run first."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        on_call()
        with torch.profiler.record_function(label):
            return function(*args, **kwargs)

    return wrapper


def _walk(nodes: Any) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _walk(node.children)


def transients(profiler: CpuProfiler) -> dict[str, int]:
    """Per label (norm, step): the largest peak-minus-start of live bytes over its ranges; a step range ends where an
    all-gather inside it starts."""
    nodes = list(_walk(profiler.profiler.kineto_results.experimental_event_tree()))
    spans = [(n.name, n.start_time_ns, n.end_time_ns) for n in nodes
             if n.tag == _EventType.TorchOp and n.name in (NORM, STEP, GATHER)]
    events = sorted((n.start_time_ns, n.extra_fields.alloc_size, n.extra_fields.total_allocated) for n in nodes
                    if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu")
    gathers = [start for name, start, _ in spans if name == GATHER]
    out = {NORM: 0, STEP: 0}
    for name, start, end in spans:
        if name == GATHER:
            continue
        if name == STEP:
            end = min([s for s in gathers if start <= s <= end], default=end)
        inside = [(size, total) for t, size, total in events if start <= t <= end]
        if inside:
            before = inside[0][1] - inside[0][0]
            out[name] = max(out[name], max(total for _, total in inside) - before)
    return out


def run_case(case: dict[str, Any], rank: int) -> dict[str, Any]:
    config = case["config"]
    model, batch_fn = build_workload(model_spec=case["model"], checkpointing="none", sequence_length=case["seq"],
                                     seed=0, entry_point=None, construction="full", ds_config=config,
                                     device=torch.device("cpu"))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    opt = engine.optimizer
    stage = int(engine.zero_optimization_stage())
    phase, calls, held = ["none"], [], [0]
    method = NORM_METHODS[stage]
    setattr(opt, method, ranged(getattr(opt, method), NORM, lambda: calls.append(phase[0])))
    if stage in (1, 2):
        copy = opt.copy_grads_in_partition

        def copy_and_count(*args: Any, **kwargs: Any) -> None:
            copy(*args, **kwargs)
            if opt.grads_in_partition is not None:
                held[0] = max(held[0], opt.grads_in_partition.numel())

        opt.copy_grads_in_partition = copy_and_count
    micro = config["train_micro_batch_size_per_gpu"]
    gas = config["gradient_accumulation_steps"]
    for step in range(STEPS):
        if step == STEPS - 1:
            calls.clear()
            profiler = start_cpu_profiler()
        for index in range(gas):
            loss = engine(batch_fn(step, list(range((2 * index + rank) * micro, (2 * index + rank + 1) * micro))))
            phase[0] = "backward"
            engine.backward(loss)
            phase[0] = "step"
            with torch.profiler.record_function(STEP):
                engine.step()  # a no-op before the accumulation boundary
            phase[0] = "none"
    profiler.stop()
    count_every_thread(False)
    peaks = transients(profiler)
    result = {"norm_calls": {p: calls.count(p) for p in ("backward", "step")}, "norm_transient": peaks[NORM],
              "step_transient": peaks[STEP], "grads_in_partition": held[0], "accumulated_grads_in_cpu": 0}
    if stage in (1, 2) and opt.cpu_offload:
        result["accumulated_grads_in_cpu"] = sum(t.numel() for t in opt.accumulated_grads_in_cpu.values())
    engine.destroy()
    return result


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    deepspeed.init_distributed()
    rank = int(os.environ["RANK"])
    zero12.all_gather_dp_groups = ranged(zero12.all_gather_dp_groups, GATHER)
    for case in cases:
        (out / f"{case['name']}.rank{rank}.json").write_text(json.dumps(run_case(case, rank)))
    # Without it gloo's worker threads are still joinable at interpreter exit (pytorch/pytorch#190489).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


main()
end_rank(0)  # no interpreter teardown, as the trials' ranks end (launchers/process/collector.py)
