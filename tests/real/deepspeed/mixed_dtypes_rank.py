"""Rank program for test_mixed_trainable_dtypes_real.py: a PEFT model whose fp32 adapters train beside a bf16
``modules_to_save`` copy, at ZeRO-3 bf16, built as the HF Trainer builds it — without any dsopt code.

Run under ``torchrun --nproc_per_node 2`` with ``DS_ACCELERATOR=cpu``. Arguments: a transformers config.json and an
output folder. Cases (each writes ``<out>/<case>.rank<r>.json``: ``ok``, the exception's type, and the file and line
of the frame that raised it; on success the loss of one step):

* ``zero_init``: ``HfDeepSpeedConfig`` alive, so ``from_config`` builds the bf16 model under ``deepspeed.zero.Init``;
  ``get_peft_model`` with ``modules_to_save: [lm_head]``; ``deepspeed.initialize``;
* ``zero_init_offload``: the same with ``offload_param: cpu`` (per-group buffers: the first forward fails instead);
* ``zero_init_no_save``: the same without ``modules_to_save`` (the adapters alone train, all fp32);
* ``built_whole``: the fp32 model built without zero.Init (dsopt's ``training.model_init: full``), then the same
  PEFT setup; the engine casts it to bf16 (``engine.py:1859-1862``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import deepspeed
import peft
import torch
import transformers
from transformers.integrations import HfDeepSpeedConfig

CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}


def run_case(name: str, config_path: Path, *, zero_init: bool, save: bool, offload: bool = False) -> dict:
    settings = json.loads(config_path.read_text())
    hf_config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    config = {**CONFIG, "zero_optimization": {"stage": 3, **({"offload_param": {"device": "cpu"}} if offload else {})}}
    keep = HfDeepSpeedConfig(config) if zero_init else None  # noqa: F841  # alive: transformers builds under zero.Init
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16 if zero_init else None)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"] if save else None)
    model = peft.get_peft_model(model, lora)
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
    try:
        engine, *_ = deepspeed.initialize(model=model, config=config,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        tokens = torch.randint(0, hf_config.vocab_size, (1, 16))
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        return {"case": name, "ok": True, "loss": float(loss), "trainable_dtypes": dtypes}
    except Exception as error:  # the failure is the finding
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return {"case": name, "ok": False, "error_type": type(error).__name__, "file": frame.filename,
                "line": frame.lineno, "trainable_dtypes": dtypes, "message": str(error)[:300]}


def main() -> int:
    config_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    # the failing cases last: a half-made engine stays behind each
    cases = (("zero_init_no_save", True, False, False), ("built_whole", False, True, False),
             ("zero_init_offload", True, True, True), ("zero_init", True, True, False))
    for name, zero_init, save, offload in cases:
        result = run_case(name, config_path, zero_init=zero_init, save=save, offload=offload)
        (out / f"{name}.rank{rank}.json").write_text(json.dumps({**result, "message": result.get("message", "")}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # what the half-made engine does at interpreter exit (a SIGSEGV in teardown) is not the question


if __name__ == "__main__":
    main()
