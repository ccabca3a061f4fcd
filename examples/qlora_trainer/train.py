"""QLoRA fine-tuning of a tiny Llama on a local text file with the Hugging Face Trainer, bitsandbytes, PEFT and
DeepSpeed, written the way the QLoRA recipes show it (https://huggingface.co/docs/peft/developer_guides/quantization,
https://huggingface.co/docs/peft/accelerate/deepspeed "DeepSpeed ZeRO-3 and QLoRA"): the base loaded with
``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))``,
``prepare_model_for_kbit_training``, ``get_peft_model(model, LoraConfig(...))``, then ``Trainer(...).train()`` with
``--deepspeed ds_config.json``; only the adapters train.

    torchrun --nproc_per_node 2 train.py --deepspeed ds_config.json --output_dir out --max_steps 20 \\
        --per_device_train_batch_size 2 --gradient_accumulation_steps 2

It knows nothing of dsopt. There is no hub here: the base is the tiny Llama's config with seeded random weights,
saved once under ``--base`` and loaded from there in 4 bits, as a downloaded checkpoint would be. The quantization and
the LoRA setup below are the study's ``model.quantization`` and ``model.peft`` (study.yaml): the plan holds for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)

HERE = Path(__file__).resolve().parent


@dataclass
class DataArguments:
    model: str = field(default=str(HERE.parent / "tiny-llama"), metadata={"help": "a transformers config folder"})
    base: str = field(default="base", metadata={"help": "where the seeded base checkpoint is saved and loaded from"})
    data: str = field(default=str(HERE.parent / "data" / "tiny_corpus.txt"))
    sequence_length: int = 64
    lora_r: int = 8


def base_checkpoint(config_folder: str, folder: Path, seed: int) -> Path:
    """A checkpoint of the config's model with seeded weights, written once (the stand-in for a downloaded one)."""
    if not (folder / "config.json").is_file():
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_folder)).save_pretrained(folder)
    return folder


def main() -> None:
    # the checkpoint is written before the training arguments exist: with a ZeRO-3 config they switch transformers'
    # from_config to deepspeed.zero.Init, whose partitioned weights would be saved empty
    data_args, rest = HfArgumentParser(DataArguments).parse_args_into_dataclasses(return_remaining_strings=True)
    seed = int(rest[rest.index("--seed") + 1]) if "--seed" in rest else 42
    base = base_checkpoint(data_args.model, Path(data_args.base), seed)
    (training_args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(args=rest)
    dtype = torch.bfloat16 if training_args.bf16 else torch.float32
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=quantization, dtype=dtype)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=training_args.gradient_checkpointing)
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
