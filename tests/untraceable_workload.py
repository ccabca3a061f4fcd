"""An entry point whose forward has a data-dependent shape (``torch.nonzero``): it trains, but cannot be traced
on fake tensors (tests/launchers/trace/test_trace.py)."""

from __future__ import annotations

import torch

from launchers.models.builtin import GPT


class _Masked(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = torch.nonzero(tokens[:, 0] >= 0).flatten()  # data-dependent output shape
        return self.inner(tokens[keep])


def workload(spec, sequence_length, seed, checkpointing):
    return _Masked(GPT(spec, checkpointing=checkpointing)), None
