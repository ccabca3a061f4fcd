"""Train a tiny Llama on a local text file with Hugging Face Accelerate and a DeepSpeed plugin config file, written
the way Accelerate's DeepSpeed guide shows it (https://huggingface.co/docs/accelerate/usage_guides/deepspeed):
``DeepSpeedPlugin(hf_ds_config=...)`` into ``Accelerator``, ``DummyOptim`` where the config names the optimizer,
``accelerator.prepare``, then ``accelerator.accumulate`` / ``accelerator.backward`` / ``optimizer.step``.

    torchrun --nproc_per_node 2 train.py --deepspeed_config_file ds_config.json --max_steps 20

It knows nothing of dsopt: the micro-batch (the DataLoader's batch size), accumulation, ZeRO stage, offload and
precision come from the DeepSpeed config file; recomputation from ``--gradient_checkpointing``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import DummyOptim, set_seed
from transformers import AutoConfig, AutoModelForCausalLM

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config_file", required=True)
    parser.add_argument("--model", default=str(HERE.parent / "tiny-llama"), help="a transformers config folder")
    parser.add_argument("--data", default=str(HERE.parent / "data" / "tiny_corpus.txt"))
    parser.add_argument("--sequence_length", type=int, default=64)
    parser.add_argument("--max_steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--gradient_checkpointing", choices=("true", "false"), default="false")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    plugin = DeepSpeedPlugin(hf_ds_config=args.deepspeed_config_file)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    set_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    if args.gradient_checkpointing == "true":
        model.gradient_checkpointing_enable()
    optimizer = DummyOptim(model.parameters())  # the config file's optimizer section makes the real one
    micro_batch = plugin.deepspeed_config["train_micro_batch_size_per_gpu"]
    data = torch.tensor(list(Path(args.data).read_bytes()), dtype=torch.long)  # byte-level tokens (vocabulary 256)
    blocks = data[: len(data) // args.sequence_length * args.sequence_length].view(-1, args.sequence_length)
    loader = torch.utils.data.DataLoader(blocks, batch_size=micro_batch, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    steps = 0
    while steps < args.max_steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                steps += 1
                accelerator.print(f"step {steps} loss {loss.item():.4f}")
                if steps >= args.max_steps:
                    break


if __name__ == "__main__":
    main()
