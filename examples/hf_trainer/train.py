"""Train a tiny Llama on a local text file with the Hugging Face Trainer and DeepSpeed, written the way the
Trainer's DeepSpeed guide shows it (https://huggingface.co/docs/transformers/deepspeed): ``HfArgumentParser`` over
``TrainingArguments``, ``--deepspeed ds_config.json``, the model made *after* the arguments (so that at ZeRO-3 it
is built partitioned under ``deepspeed.zero.Init``), then ``Trainer(...).train()``.

    torchrun --nproc_per_node 2 train.py --deepspeed ds_config.json --output_dir out --max_steps 20 \\
        --per_device_train_batch_size 2 --gradient_accumulation_steps 2 --bf16 true --gradient_checkpointing true

It knows nothing of dsopt. Its JSON is the ``--hf`` form ("auto" batch sizes and optimizer values, filled by the
Trainer from these arguments); ZeRO stage and offload come from the JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments, set_seed

HERE = Path(__file__).resolve().parent


@dataclass
class DataArguments:
    model: str = field(default=str(HERE.parent / "tiny-llama"), metadata={"help": "a transformers config folder"})
    data: str = field(default=str(HERE.parent / "data" / "tiny_corpus.txt"))
    sequence_length: int = 64


def main() -> None:
    data_args, training_args = HfArgumentParser((DataArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(training_args.seed)  # before the model is made, as transformers' own example scripts do
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(data_args.model))
    data = torch.tensor(list(Path(data_args.data).read_bytes()), dtype=torch.long)  # byte-level tokens (vocab 256)
    length = data_args.sequence_length
    dataset = [{"input_ids": block, "labels": block} for block in data[: len(data) // length * length].view(-1, length)]
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    trainer.train()


if __name__ == "__main__":
    main()
