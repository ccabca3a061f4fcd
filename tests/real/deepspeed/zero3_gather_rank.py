"""Rank program for test_zero3_gather_real.py: what real ZeRO-3 holds gathered when forward ends.

Run under ``torchrun --nproc_per_node 2`` with ``DS_ACCELERATOR=cpu``. Arguments: a JSON file of cases
({name, model (launchers.trial.run.model_dict), config (DeepSpeed JSON), seq}) and an output folder. Each case
builds the model as trials do, trains three steps and, after the forward of each step, counts the parameters
DeepSpeed holds gathered or in flight (``ds_status`` AVAILABLE or INFLIGHT, persistent ones left out). Writes
``<out>/<case>.rank<r>.json``: the counts per step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from launchers.models.builtin import build_workload

HELD = (ZeroParamStatus.AVAILABLE, ZeroParamStatus.INFLIGHT)


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    deepspeed.init_distributed()
    rank = int(os.environ["RANK"])
    for case in cases:
        model, batch_fn = build_workload(model_spec=case["model"], checkpointing="none", sequence_length=case["seq"],
                                         seed=0, entry_point=None, construction="full", ds_config=case["config"],
                                         device=torch.device("cpu"))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                          config=case["config"])
        held = []
        for step in range(3):
            micro = case["config"]["train_micro_batch_size_per_gpu"]
            loss = engine(batch_fn(step, list(range(rank * micro, rank * micro + micro))))
            held.append(sum(p.ds_numel for p in model.parameters() if p.ds_status in HELD and not p.ds_persist))
            engine.backward(loss)
            engine.step()
        (out / f"{case['name']}.rank{rank}.json").write_text(json.dumps({"held_after_forward": held}))
        engine.destroy()
    # Without it gloo's worker threads are still joinable at interpreter exit: "terminate called without
    # an active exception", SIGABRT after the work is done (pytorch/pytorch#190489; CI of stop 20 saw it here).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


main()
