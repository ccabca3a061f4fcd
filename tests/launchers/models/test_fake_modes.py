"""A deep-copied fake module (PEFT's ``modules_to_save``) joins the trace's fake mode (models/fake_kernels.py).

Run in a process of its own: a fake tensor's deep copy leaves a second fake mode behind, after which torch's
profiler, started later in the same process, can crash (seen in the suite: a SIGSEGV in ``profile.__init__``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BODY = """
import copy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from launchers.models.fake_kernels import in_one_fake_mode

with FakeTensorMode() as mode:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    model.append(copy.deepcopy(model[0]))  # what ModulesToSaveWrapper does
    model[2].weight.requires_grad_(False)
    assert model[2].weight.fake_mode is not mode  # an op on it and the trace's tensors: "Mixing fake modes NYI"
    before = [(n, p.shape, p.stride(), p.dtype, p.requires_grad) for n, p in model.named_parameters()]
    assert in_one_fake_mode(model, mode) == 2  # the copy's weight and bias; the others were the mode's
    assert [(n, p.shape, p.stride(), p.dtype, p.requires_grad) for n, p in model.named_parameters()] == before
    assert model[2](model[1](model[0](torch.randn(2, 4)))[:, :4]).shape == (2, 8)
    assert in_one_fake_mode(model, mode) == 0
print("ok")
"""


def test_a_deep_copy_gets_a_mode_of_its_own_until_made_one_of_the_traces():
    proc = subprocess.run([sys.executable, "-c", BODY], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-3000:]
