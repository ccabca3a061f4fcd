"""Entry-point workloads that fail on purpose, for the fault tests (``model.entry_point: faulty_workloads:X``).

Each wraps the built-in GPT and data and fails at optimizer step 2 (after warm-up has started), in one way:
a NaN loss, a hang on rank 0, rank 1 killed by SIGKILL, or an allocation no machine can satisfy.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from launchers.models.builtin import build_workload

FAIL_AT_STEP = 2


def _base(spec, sequence_length, seed, checkpointing):
    return build_workload(model_spec=spec, checkpointing=checkpointing, sequence_length=sequence_length, seed=seed,
                          entry_point=None)


class _NanAfter(torch.nn.Module):
    """The wrapped model's loss, turned NaN from the ``after``-th forward call on."""

    def __init__(self, inner: torch.nn.Module, *, after: int) -> None:
        super().__init__()
        self.inner = inner
        self.after = after
        self.calls = 0

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = self.inner(batch)
        return loss * float("nan") if self.calls >= self.after else loss


def nan_workload(spec, sequence_length, seed, checkpointing):
    model, data = _base(spec, sequence_length, seed, checkpointing)
    return _NanAfter(model, after=3), data


def hang_workload(spec, sequence_length, seed, checkpointing):
    model, data = _base(spec, sequence_length, seed, checkpointing)

    def batch_fn(step, indices):
        if step == FAIL_AT_STEP and int(os.environ.get("RANK", "0")) == 0:
            Path(__file__).with_name("hang_reached.marker").touch()  # beside this copy, in the study's folder
            time.sleep(3600)
        return data(step, indices)

    return model, batch_fn


def crash_workload(spec, sequence_length, seed, checkpointing):
    model, data = _base(spec, sequence_length, seed, checkpointing)

    def batch_fn(step, indices):
        if step == FAIL_AT_STEP and int(os.environ.get("RANK", "0")) == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return data(step, indices)

    return model, batch_fn


def oom_workload(spec, sequence_length, seed, checkpointing):
    model, data = _base(spec, sequence_length, seed, checkpointing)

    def batch_fn(step, indices):
        if step == FAIL_AT_STEP:
            torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the CPU allocator refuses
        return data(step, indices)

    return model, batch_fn


CRASHED_ONCE = "crashed_once.marker"
"""Left beside this module by :func:`crash_once_workload`'s first crash."""


def crash_once_workload(spec, sequence_length, seed, checkpointing):
    """A transient crash: a 16-bit trial's rank 1 is SIGKILLed at step 2 the first time only (the FP32
    reference and every later launch run clean)."""
    model, data = _base(spec, sequence_length, seed, checkpointing)
    marker = Path(__file__).with_name(CRASHED_ONCE)
    sixteen_bit = torch.get_default_dtype() != torch.float32  # the device construction builds in the training dtype

    def batch_fn(step, indices):
        if sixteen_bit and step == FAIL_AT_STEP and int(os.environ.get("RANK", "0")) == 1 and not marker.exists():
            marker.write_text("crashed\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return data(step, indices)

    return model, batch_fn
