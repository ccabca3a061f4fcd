"""Train a transformers causal LM under the Hugging Face Trainer with an exported ``--hf`` DeepSpeed JSON.

The path a user takes with dsopt's export, run by ``benchmarks/gpu_check.py`` under
``python -m torch.distributed.run``: ``TrainingArguments(deepspeed=JSON)`` is created *before* the model, so
that at stage 3 transformers builds it under ``deepspeed.zero.Init`` (``HfDeepSpeedConfig`` is alive), the
model comes from ``from_config`` in the training dtype, and the Trainer fills the JSON's ``"auto"`` values
from its arguments. Rank 0 writes ``--out``: the per-step losses, whether the parameters came out
partitioned, and the CUDA peaks (allocated, reserved) when on a GPU.

``--cpu`` (the dry mode's CPU rank): ``use_cpu=True``; the Trainer then gives DeepSpeed one process, so the
dry mode runs one rank (several CPU ranks under the Trainer fail DeepSpeed's batch-size check: the Trainer
counts the processes, DeepSpeed's group has one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from launchers.process.collector import no_collection_at_exit
from launchers.process.cpu_info import install as keep_cpu_info

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> int:
    keep_cpu_info()  # py-cpuinfo asked once per node (launchers/process/cpu_info.py)
    no_collection_at_exit()  # the report written, no full collection of the heap (launchers/process/collector.py)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ds-config", required=True)
    parser.add_argument("--hf-config", required=True, help="a transformers config.json (model_type + fields)")
    parser.add_argument("--precision", choices=tuple(DTYPES), required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--sequence-length", type=int, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    settings = json.loads(Path(args.hf_config).read_text())
    model_type = settings.pop("model_type")
    with tempfile.TemporaryDirectory(prefix="dsopt-hf-trainer-") as tmp:
        training_args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.accumulation, max_steps=args.steps, learning_rate=1e-3,
            bf16=args.precision == "bf16", fp16=args.precision == "fp16", deepspeed=args.ds_config,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=args.cpu, seed=0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings),
                                                 dtype=DTYPES[args.precision])
        partitioned = any(hasattr(p, "ds_id") for p in model.parameters())  # zero.Init's mark
        generator = torch.Generator().manual_seed(0)
        vocab = int(settings["vocab_size"])
        rows = args.micro_batch * args.accumulation * int(os.environ.get("WORLD_SIZE", "1")) * args.steps
        data = []
        for _ in range(rows):  # learnable: an affine chain from a random start, so the loss can fall
            start = torch.randint(0, vocab, (1,), generator=generator)
            tokens = (start + 7 * torch.arange(args.sequence_length)) % vocab
            data.append({"input_ids": tokens, "labels": tokens})
        trainer = Trainer(model=model, args=training_args, train_dataset=data)
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if int(os.environ.get("RANK", "0")) == 0:
        cuda = torch.cuda.is_available() and not args.cpu
        Path(args.out).write_text(json.dumps({
            "losses": losses, "built_partitioned": partitioned,
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()) if cuda else None,
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()) if cuda else None,
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
