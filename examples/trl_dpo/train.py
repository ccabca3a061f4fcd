"""DPO of a tiny Llama against a frozen reference model with TRL's ``DPOTrainer`` and DeepSpeed, written the way
TRL's DPO documentation shows it (https://huggingface.co/docs/trl/dpo_trainer): a ``DPOConfig`` (the HF Trainer's
arguments, ``--deepspeed ds_config.json`` among them), the policy and the reference built after the arguments (at
ZeRO-3 both under ``deepspeed.zero.Init``), ``DPOTrainer(model, ref_model, ...).train()``. TRL wraps the reference
in a DeepSpeed engine of its own with no optimizer (stage 0 unless the config's is 3: ``prepare_deepspeed``).

    torchrun --nproc_per_node 2 train.py --deepspeed ds_config.json --output_dir out --max_steps 20 \\
        --per_device_train_batch_size 2 --gradient_accumulation_steps 2

It knows nothing of dsopt. The preference pairs are built from a local text file (a prompt, its true continuation
as "chosen", a shuffled one as "rejected"), tokenized byte by byte (vocabulary 256, the tiny Llama's) — nothing is
downloaded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer

HERE = Path(__file__).resolve().parent


@dataclass
class DataArguments:
    model: str = field(default=str(HERE.parent / "tiny-llama"), metadata={"help": "a transformers config folder"})
    data: str = field(default=str(HERE.parent / "data" / "tiny_corpus.txt"))
    prompt_length: int = 24
    completion_length: int = 8


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer of 256 ids (byte b is id b: BPE over GPT-2's byte alphabet with no merges), the
    newline as end of text and padding."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    symbol = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}  # bytes_to_unicode
    tokenizer = Tokenizer(models.BPE(vocab={symbol[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=symbol[10], pad_token=symbol[10])


def preference_pairs(text: bytes, *, prompt: int, completion: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    step = prompt + completion
    rows = []
    for start in range(0, len(text) - step, step):
        block = text[start:start + step].decode("latin-1")
        chosen = block[prompt:]
        rejected = "".join(rng.sample(chosen, len(chosen)))
        rows.append({"prompt": block[:prompt], "chosen": chosen, "rejected": rejected})
    return Dataset.from_list(rows)


def main() -> None:
    data_args, args = HfArgumentParser((DataArguments, DPOConfig)).parse_args_into_dataclasses()
    config = AutoConfig.from_pretrained(data_args.model)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(args.seed)
    reference = AutoModelForCausalLM.from_config(config)  # the policy before training
    dataset = preference_pairs(Path(data_args.data).read_bytes(), prompt=data_args.prompt_length,
                               completion=data_args.completion_length, seed=args.seed)
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=dataset,
                         processing_class=byte_tokenizer())
    trainer.train()


if __name__ == "__main__":
    main()
