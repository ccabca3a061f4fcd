"""The replay of DeepSpeed's ZeRO-3 coordinator (optimizer/deepspeed/zero3_gather.py, over the traced module order)
against real DeepSpeed on 2 CPU ranks: the parameters held gathered or in flight when forward ends, once the coordinator
has its trace (from the second step), must equal the replay's figure exactly — for the built-in GPT and a
transformers Qwen2 (biases on q/k/v), in fp32 and bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from two_ranks import run_two_ranks

from launchers.trace.tracer import trace
from launchers.trial.run import model_dict
from optimizer.deepspeed.config import build_ds_config
from optimizer.study.knobs import Candidate, NoCheckpointing, OffloadDevice, Precision, ZeroStage
from optimizer.study.specs import Accelerator, HardwareSpec, TrainingSpec, TransformerModel
from optimizer.study.study_file import load_study

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
HARDWARE = HardwareSpec(accelerator=Accelerator.CPU, gpus_per_node=2, gpu_memory_bytes=4 * 2**30,
                        supported_precisions=(Precision.FP32, Precision.BF16))
TRAINING = TrainingSpec(global_batch_size=4, micro_batch_size=2, sequence_length=32)


def _models(folder: Path) -> dict[str, TransformerModel]:
    gpt = TransformerModel(layers=3, hidden_size=64, heads=4, kv_heads=4, ffn_size=256, vocab_size=256,
                           max_positions=32)
    config = json.loads((ROOT / "tests" / "data" / "hf_families.json").read_text())["qwen2"]["config"]
    path = folder / "dsopt-zero3-qwen2.yaml"
    path.write_text(json.dumps({"name": "zero3-qwen2", "model": {"kind": "transformer", "hf_config": config},
                                "hardware": {"accelerator": "cpu", "gpus_per_node": 2, "gpu_memory": "4 GiB"},
                                "training": {"global_batch_size": 4, "micro_batch_size": 2, "sequence_length": 32},
                                "search_space": {"knobs": {"zero_stage": [3]}}}))
    return {"gpt": gpt, "qwen2": load_study(path).model}


def test_the_replay_equals_what_deepspeed_holds_when_forward_ends(tmp_path):
    cases, expected = [], {}
    for name, model in _models(tmp_path).items():
        for precision in (Precision.FP32, Precision.BF16):
            candidate = Candidate(zero_stage=ZeroStage.PARAMETERS, offload_optimizer=OffloadDevice.NONE,
                                  offload_param=OffloadDevice.NONE, precision=precision,
                                  checkpointing=NoCheckpointing(), micro_batch_size=TRAINING.micro_batch_size)
            spec = model_dict(model)
            case = f"{name}-{precision}"
            cases.append({"name": case, "model": spec, "seq": TRAINING.sequence_length,
                          "config": build_ds_config(candidate=candidate, model=model, hardware=HARDWARE,
                                                    training=TRAINING)})
            traced = trace(model_spec=spec, checkpointing="none", precision=precision,
                           micro_batch=TRAINING.micro_batch_size, sequence_length=TRAINING.sequence_length)
            expected[case] = traced.zero3_gathered_after_forward
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run_two_ranks(HERE / "zero3_gather_rank.py", str(tmp_path / "cases.json"), str(tmp_path))
    for case in cases:
        for rank in range(2):
            report = json.loads((tmp_path / f"{case['name']}.rank{rank}.json").read_text())
            held = [step["held_after_forward"] for step in report["steps"]]
            assert held[0] == 0  # the first step records the trace: everything released after use
            assert held[1] == held[2] == expected[case["name"]] > 0, (case["name"], held, expected[case["name"]])
