"""A training script with a frozen reference model, in TRL's order (tests): the reference is wrapped first by an
engine with no optimizer, at stage 0 unless the config's is 3 (``trl/models/utils.py`` ``prepare_deepspeed``), then
the policy's engine from the candidate's config; each step runs the policy's forward, the reference's under
no_grad, and trains the loss anchored to the reference's. The hook must measure the policy's engine."""

import argparse
import copy
import json
from pathlib import Path

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM

HERE = Path(__file__).resolve().parent
parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config")
parser.add_argument("--max-steps", type=int, default=20)
args = parser.parse_args()
config = json.loads(Path(args.deepspeed_config).read_text())
reference_config = copy.deepcopy(config)
reference_config.pop("optimizer", None)
reference_config["zero_optimization"].pop("offload_optimizer", None)
if reference_config["zero_optimization"].get("stage", 0) != 3:
    reference_config["zero_optimization"]["stage"] = 0
deepspeed.init_distributed()
model_config = AutoConfig.from_pretrained(HERE.parent / "tiny-llama")
torch.manual_seed(0)
reference = AutoModelForCausalLM.from_config(model_config).requires_grad_(False)
reference, *_ = deepspeed.initialize(model=reference, config=reference_config)
reference.eval()
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(model_config)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
micro = config["train_micro_batch_size_per_gpu"]
data = torch.tensor(list((HERE.parent / "data" / "tiny_corpus.txt").read_bytes()), dtype=torch.long)[: 64 * 64]
blocks = data.view(-1, 64)
step = 0
while engine.global_steps < args.max_steps:
    batch = blocks[(step * micro) % 60:(step * micro) % 60 + micro]
    step += 1
    loss = engine(input_ids=batch, labels=batch).loss
    with torch.no_grad():
        reference_loss = reference(input_ids=batch, labels=batch).loss
    engine.backward(loss + 0.1 * (loss - reference_loss) ** 2)
    engine.step()
