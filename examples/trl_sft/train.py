"""LoRA supervised fine-tuning of a tiny Llama with TRL's ``SFTTrainer``, PEFT and DeepSpeed, written the way TRL's
SFT documentation shows it (https://huggingface.co/docs/trl/sft_trainer): an ``SFTConfig`` (the HF Trainer's
arguments, ``--deepspeed ds_config.json`` among them), the model built after the arguments (under
``deepspeed.zero.Init`` at ZeRO-3), ``SFTTrainer(model, ..., peft_config=LoraConfig(...)).train()``. The trainer
wraps the model with PEFT and adds TRL's fused LM head (log-probabilities in tiles, no logits).

    torchrun --nproc_per_node 2 train.py --deepspeed ds_config.json --output_dir out --max_steps 20 \\
        --per_device_train_batch_size 2 --gradient_accumulation_steps 2 --gradient_checkpointing true

It knows nothing of dsopt. The data are blocks of a local text file, tokenized byte by byte (vocabulary 256, the
tiny Llama's) — nothing is downloaded. The LoRA setup below is the study's ``model.peft`` (study.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, PreTrainedTokenizerFast, set_seed
from trl import SFTConfig, SFTTrainer

HERE = Path(__file__).resolve().parent


@dataclass
class DataArguments:
    model: str = field(default=str(HERE.parent / "tiny-llama"), metadata={"help": "a transformers config folder"})
    data: str = field(default=str(HERE.parent / "data" / "tiny_corpus.txt"))
    sequence_length: int = 64
    lora_r: int = 8


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


def main() -> None:
    data_args, args = HfArgumentParser((DataArguments, SFTConfig)).parse_args_into_dataclasses()
    set_seed(args.seed)  # before the model is made, as transformers' own example scripts do
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(data_args.model))
    text = Path(data_args.data).read_bytes()
    length = data_args.sequence_length
    dataset = Dataset.from_list([{"input_ids": list(text[start:start + length])}  # already tokenized: bytes
                                 for start in range(0, len(text) - length + 1, length)])
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=byte_tokenizer(),
                         peft_config=LoraConfig(r=data_args.lora_r, lora_alpha=2 * data_args.lora_r,
                                                lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                                task_type="CAUSAL_LM"))
    trainer.train()


if __name__ == "__main__":
    main()
