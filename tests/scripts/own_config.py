"""A training script that takes --deepspeed_config but trains with a config of its own (tests: the hook must say
the engine is not the candidate's)."""

import argparse

import deepspeed
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config")
args = parser.parse_args()
deepspeed.init_distributed()
model = torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 256))
own = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
       "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=own)
for _ in range(10):
    ids = torch.randint(0, 256, (1, 16))
    loss = torch.nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.flatten())
    engine.backward(loss)
    engine.step()
