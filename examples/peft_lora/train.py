"""LoRA fine-tuning of a tiny Llama on a local text file with the Hugging Face Trainer, PEFT and DeepSpeed, written
the way PEFT's DeepSpeed guide shows it (https://huggingface.co/docs/peft/accelerate/deepspeed): the base model made
after the arguments (under ``deepspeed.zero.Init`` at ZeRO-3), ``peft.get_peft_model(model, LoraConfig(...))``, then
``Trainer(...).train()`` with ``--deepspeed ds_config.json``; only the adapters train.

    torchrun --nproc_per_node 2 train.py --deepspeed ds_config.json --output_dir out --max_steps 20 \\
        --per_device_train_batch_size 2 --gradient_accumulation_steps 2 --gradient_checkpointing true

It knows nothing of dsopt. The LoRA setup below is the study's ``model.peft`` (study.yaml): the plan holds for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments, set_seed

HERE = Path(__file__).resolve().parent


@dataclass
class DataArguments:
    model: str = field(default=str(HERE.parent / "tiny-llama"), metadata={"help": "a transformers config folder"})
    data: str = field(default=str(HERE.parent / "data" / "tiny_corpus.txt"))
    sequence_length: int = 64
    lora_r: int = 8


def main() -> None:
    data_args, training_args = HfArgumentParser((DataArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(training_args.seed)  # before the model is made, as transformers' own example scripts do
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(data_args.model))
    model = get_peft_model(model, LoraConfig(r=data_args.lora_r, lora_alpha=2 * data_args.lora_r, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    model.print_trainable_parameters()
    data = torch.tensor(list(Path(data_args.data).read_bytes()), dtype=torch.long)  # byte-level tokens (vocab 256)
    length = data_args.sequence_length
    dataset = [{"input_ids": block, "labels": block} for block in data[: len(data) // length * length].view(-1, length)]
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    trainer.train()


if __name__ == "__main__":
    main()
