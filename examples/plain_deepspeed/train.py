"""Train a tiny Llama on a local text file with a plain DeepSpeed loop, written the way DeepSpeed's getting-started
guide shows it (https://www.deepspeed.ai/getting-started/): ``deepspeed.add_config_arguments``, ``deepspeed.initialize``
with the training data, then ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``.

    deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json
    torchrun --nproc_per_node 2 train.py --deepspeed --deepspeed_config ds_config.json

It knows nothing of dsopt: the micro-batch, accumulation, ZeRO stage, offload and precision come from the DeepSpeed
JSON; recomputation from ``--gradient-checkpointing``. It prints one line per optimizer step on rank 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(HERE.parent / "tiny-llama"), help="a transformers config folder")
    parser.add_argument("--data", default=str(HERE.parent / "data" / "tiny_corpus.txt"))
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--gradient-checkpointing", choices=("none", "full"), default="none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    if args.gradient_checkpointing == "full":
        model.gradient_checkpointing_enable()
    data = torch.tensor(list(Path(args.data).read_bytes()), dtype=torch.long)  # byte-level tokens (vocabulary 256)
    blocks = data[: len(data) // args.sequence_length * args.sequence_length].view(-1, args.sequence_length)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=list(blocks))
    engine.train()
    while engine.global_steps < args.max_steps:
        for batch in loader:
            batch = batch.to(engine.device)
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            if engine.micro_steps % engine.gradient_accumulation_steps() == 0 and engine.global_rank == 0:
                print(f"step {engine.global_steps} loss {loss.item():.4f}", flush=True)
            if engine.global_steps >= args.max_steps:
                break


if __name__ == "__main__":
    main()
