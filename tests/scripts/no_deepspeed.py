"""A training script that never calls DeepSpeed (tests: the hook must say it saw no engine)."""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config")
parser.parse_args()
model = torch.nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print("trained without DeepSpeed")
