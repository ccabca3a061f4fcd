"""Rank program for test_zero3_gather_real.py and test_zero3_recompute_real.py: what real ZeRO-3 holds gathered.

Run under ``torchrun --nproc_per_node 2`` with ``DS_ACCELERATOR=cpu``. Arguments: a JSON file of cases
({name, model (launchers.trial.run.model_dict), config (DeepSpeed JSON), seq, checkpointing (default none)}) and an
output folder. Each case builds the model as trials do (its PEFT adapters or frozen parts applied), trains three
steps and counts the non-persistent elements DeepSpeed holds gathered or in flight (``ds_status`` AVAILABLE or
INFLIGHT): after each step's forward, and after each of DeepSpeed's own four module hooks
(``DeepSpeedZeRoOffload.pre_sub_module_forward_function`` and the rest, looked up on the instance when a hook fires:
``parameter_offload.py:358-360, 403, 427, 462, 495``), wrapped to record, in DeepSpeed's order, each (kind, module
index), that count and the elements of the coalesced all-gather buffers still referenced. Writes
``<out>/<case>.rank<r>.json``: per step the count after forward, the events and the counts; the modules' own
parameter indices, each parameter's elements and which do not train.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from launchers.models.builtin import build_workload
from launchers.process.collector import end_rank

HELD = (ZeroParamStatus.AVAILABLE, ZeroParamStatus.INFLIGHT)
HOOKS = {"forward_pre": "pre_sub_module_forward_function", "forward_post": "post_sub_module_forward_function",
         "backward_pre": "pre_sub_module_backward_function", "backward_post": "post_sub_module_backward_function"}


class Recorder:
    """DeepSpeed's module hooks, wrapped: each event in its order and what is held gathered once it returned."""

    def __init__(self, params: list[torch.nn.Parameter], modules: list[torch.nn.Module]) -> None:
        self.params = params
        self.index = {id(m): i for i, m in enumerate(modules)}
        self.registry = modules[0].ds_inflight_param_registry  # parameter_offload.py:198-200
        self.events: list[tuple[str, int]] = []
        self.held: list[int] = []
        self.buffered: list[int] = []

    def count(self) -> int:
        return sum(p.ds_numel for p in self.params if p.ds_status in HELD and not p.ds_persist)

    def flat_elements(self) -> int:
        """Elements of the coalesced all-gather buffers still referenced after their wait: a handle keeps its
        flat buffer's partitions (partition_parameters.py:750, 781-796) while a parameter of its bucket is in the
        registry (partitioned_param_coordinator.py:398-406, 613)."""
        handles: dict[int, Any] = {}
        for handle in self.registry.values():
            for one in getattr(handle, "handles", [handle]):  # MultipleAllGatherHandles: one per dtype
                handles[id(one)] = one
        return sum(sum(part.numel() for part in one.partitions) for one in handles.values()
                   if getattr(one, "complete", False) and getattr(one, "partitions", None))

    def wrap(self, kind: str, original: Any) -> Any:
        @functools.wraps(original)
        def hook(sub_module: torch.nn.Module) -> Any:
            result = original(sub_module)
            if id(sub_module) in self.index:
                self.events.append((kind, self.index[id(sub_module)]))
                self.held.append(self.count())
                self.buffered.append(self.flat_elements())
            return result
        return hook


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    deepspeed.init_distributed()
    rank = int(os.environ["RANK"])
    for case in cases:
        model, batch_fn = build_workload(model_spec=case["model"], checkpointing=case.get("checkpointing", "none"),
                                         sequence_length=case["seq"], seed=0, entry_point=None, construction="full",
                                         ds_config=case["config"], device=torch.device("cpu"))
        engine, *_ = deepspeed.initialize(model=model, config=case["config"],
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        params = list(model.parameters())
        modules = list(model.modules())
        recorder = Recorder(params, modules)
        offload = engine.optimizer.parameter_offload
        for kind, name in HOOKS.items():
            setattr(offload, name, recorder.wrap(kind, getattr(offload, name)))
        steps = []
        for step in range(3):
            for log in (recorder.events, recorder.held, recorder.buffered):
                log.clear()
            micro = case["config"]["train_micro_batch_size_per_gpu"]
            loss = engine(batch_fn(step, list(range(rank * micro, rank * micro + micro))))
            after_forward = recorder.count()
            engine.backward(loss)
            engine.step()
            steps.append({"held_after_forward": after_forward, "events": list(recorder.events),
                          "held": list(recorder.held), "buffered": list(recorder.buffered)})
        position = {id(p): i for i, p in enumerate(params)}
        (out / f"{case['name']}.rank{rank}.json").write_text(json.dumps({
            "steps": steps,
            "module_params": [[position[id(p)] for p in m.parameters(recurse=False)] for m in modules],
            "numel": [int(p.ds_numel) for p in params],
            "frozen": [i for i, p in enumerate(params) if not p.requires_grad]}))
        engine.destroy()
    # Without it gloo's worker threads are still joinable at interpreter exit: "terminate called without
    # an active exception", SIGABRT after the work is done (pytorch/pytorch#190489; CI of stop 20 saw it here).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


main()
end_rank(0)  # no interpreter teardown, as the trials' ranks end: the abort came back once even so (CI, 2026-12-07)
