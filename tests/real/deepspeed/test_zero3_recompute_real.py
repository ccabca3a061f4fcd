"""The replay of DeepSpeed's ZeRO-3 coordinator (optimizer/deepspeed/zero3_gather.py) against real DeepSpeed on 2
CPU ranks, hook by hook, with full checkpointing: once the coordinator has its trace (from the second step), the
elements held gathered or in flight after each of DeepSpeed's module hooks, and those of the coalesced all-gather
buffers still referenced then, must equal the replay's figures after the same event.

* A recomputed block's frozen parameters (LoRA adapters on a frozen transformers Llama; a Llama with its embedding and
  lower layer frozen), with no prefetch and no reuse window — on so small a model they keep every parameter gathered
  from forward to backward anyway, so only the recomputation's own rule can hold one there. Replayed without that
  rule (``frozen`` left out), the same events fall short inside the recomputation: asserted, so the test fails if
  DeepSpeed stops holding them.
* The coalesced prefetch buckets' flat buffers, with the sizes dsopt sets (the frozen Llama, transformers' Qwen2
  fully fine-tuned, bf16): in the first step that prefetches (``first_step``: its persistent parameters arrive
  partitioned and join the buckets) and in the next; asserted non-zero somewhere and larger in the first step, so
  the test fails if DeepSpeed stops keeping them or starts the first step with them gathered.
* The trace's module events (:mod:`launchers.trace.zero3_events`, what the ledger replays the coordinator over) are
  DeepSpeed's own, event for event, in every case: a recomputation that stops early ends no module's forward, and
  backward's marks fire in the order of DeepSpeed's autograd functions.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from two_ranks import TWO_CPU_RANKS, run_two_ranks

import launchers.trace.tracer as tracer
from launchers.trace.inventory import adapted_inventory
from launchers.trial.run import model_dict
from optimizer.deepspeed.config import build_ds_config
from optimizer.deepspeed.zero3_gather import replay
from optimizer.deepspeed.zero_settings import gather_settings
from optimizer.study.knobs import Candidate, FullCheckpointing, OffloadDevice, Precision, ZeroStage
from optimizer.study.study_file import load_study
from optimizer.study.traced_activation import ZERO3_RUN

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
CASES = {  # name: (study, precision, without prefetch and reuse)
    "lora-recompute": ("grid-lora-llama-cpu", Precision.FP32, True),
    "frozen-recompute": ("grid-frozen-llama-cpu", Precision.FP32, True),
    "frozen-buckets": ("grid-frozen-llama-cpu", Precision.BF16, False),
    "qwen2-buckets": ("grid-qwen2-cpu", Precision.BF16, False),
}


REPLAYED = tracer.zero3_gathered


def _traced_events(model: dict, *, precision: Precision, seq: int, monkeypatch: pytest.MonkeyPatch) -> list:
    """The module events the tracer replays the coordinator over, for one micro-batch with full checkpointing."""
    seen: list = []

    def keep(model, modules, tracker, model_spec, reference=None):
        seen.extend(tracker.module_events)
        return REPLAYED(model, modules, tracker, model_spec, reference=reference)

    monkeypatch.setattr(tracer, "zero3_gathered", keep)
    result = tracer.trace(model_spec={**model, ZERO3_RUN: True}, checkpointing="full", precision=precision,
                          micro_batch=1, sequence_length=seq)
    assert isinstance(result, tracer.TraceResult), result
    return seen


def test_the_replay_holds_what_deepspeed_holds_hook_by_hook(tmp_path, monkeypatch):
    cases, settings, traced = [], {}, {}
    for name, (study_name, precision, bare) in CASES.items():
        study = adapted_inventory(load_study(ROOT / "studies" / f"{study_name}.yaml"))
        candidate = Candidate(zero_stage=ZeroStage.PARAMETERS, offload_optimizer=OffloadDevice.NONE,
                              offload_param=OffloadDevice.NONE, precision=precision,
                              checkpointing=FullCheckpointing(), micro_batch_size=1)
        config = build_ds_config(candidate=candidate, model=study.model, hardware=TWO_CPU_RANKS,
                                 training=study.training)
        settings[name] = gather_settings(study.model.hidden_size)
        if bare:
            config["zero_optimization"].update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
            settings[name] = dataclasses.replace(settings[name], prefetch_bucket=0, max_reuse_distance=0)
        cases.append({"name": name, "model": model_dict(study.model), "seq": study.training.sequence_length,
                      "checkpointing": "full", "config": config})
        traced[name] = _traced_events(model_dict(study.model), precision=precision,
                                      seq=study.training.sequence_length, monkeypatch=monkeypatch)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run_two_ranks(HERE / "zero3_gather_rank.py", str(tmp_path / "cases.json"), str(tmp_path))
    for name, (_, _, bare) in CASES.items():
        for rank in range(2):
            report = json.loads((tmp_path / f"{name}.rank{rank}.json").read_text())
            assert report["frozen"] or not bare, name  # the recomputation cases train in part
            first_buffered = 0
            for number, step in enumerate(report["steps"][1:], start=1):
                events = [tuple(e) for e in step["events"]]
                assert [tuple(e) for e in traced[name]] == events, (name, rank, number)  # the trace's own order
                recomputing = [i for i, (kind, _) in enumerate(events)
                               if kind == "forward_pre" and any(k == "backward_pre" for k, _ in events[:i])]
                assert recomputing, name  # full checkpointing: forwards inside backward
                kwargs = {"events": events, "module_params": report["module_params"], "param_numel": report["numel"],
                          "settings": settings[name], "frozen": report["frozen"], "first_step": number == 1}
                held = replay(**kwargs)
                assert held == step["held"], (name, rank, number)
                buffered = [b - h for b, h in zip(replay(**kwargs, buffers=True), held, strict=True)]
                assert buffered == step["buffered"], (name, rank, number)
                if bare:
                    without = replay(**{**kwargs, "frozen": ()})
                    assert max(without[i] for i in recomputing) < max(held[i] for i in recomputing), name
                elif number == 1:
                    first_buffered = sum(buffered)
                else:
                    assert 0 < sum(buffered) < first_buffered, name
