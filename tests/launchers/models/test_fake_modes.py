"""A deep-copied fake module (PEFT's ``modules_to_save``) joins the trace's fake mode (models/fake_kernels.py).

Run in a process of its own: a fake tensor's deep copy leaves a second fake mode behind, after which torch's
profiler, started later in the same process, can crash (seen in the suite: a SIGSEGV in ``profile.__init__``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
    shared = torch.nn.Linear(4, 4)
    pair = torch.nn.ModuleList([shared, torch.nn.Linear(4, 4)])
    pair[1].weight = shared.weight  # a tensor shared inside the module PEFT copies
    twin = copy.deepcopy(pair)
    assert in_one_fake_mode(twin, mode) == 3  # the shared weight once, both biases
    assert twin[0].weight is twin[1].weight and twin[0].weight.fake_mode is mode
print("ok")
"""
PEFT_TRACE = """
import dataclasses, json
import launchers.trace.tracer as tracer
from launchers.trace.inventory import with_inventory
from launchers.trace.tracer import TraceResult, trace

remade = []
one_mode = tracer.in_one_fake_mode
tracer.in_one_fake_mode = lambda model, mode: remade.append(one_mode(model, mode)) or remade[-1]
from launchers.trial.run import model_dict
from optimizer.study.knobs import Precision
from optimizer.study.study_file import load_study

study = load_study("studies/grid-lora-llama-cpu.yaml")
fields = {**json.loads(study.model.peft), "modules_to_save": ["lm_head"]}
model = dataclasses.replace(study.model, peft=json.dumps(fields, sort_keys=True, separators=(",", ":")))
study = with_inventory(dataclasses.replace(study, model=model))
result = trace(model_spec=model_dict(study.model), checkpointing="none", precision=Precision.FP32, micro_batch=1,
               sequence_length=study.training.sequence_length)
assert isinstance(result, TraceResult), result
assert result.parameters == study.model.inventory.trainable_parameters, (result.parameters, study.model.inventory)
assert remade == [0], remade  # PEFT's copy of the head was made in the trace's mode: nothing to remake
print("ok")
"""
COPIES = """
import copy, gc
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from launchers.models.fake_kernels import copies_keep_their_fake_mode

with FakeTensorMode() as mode, copies_keep_their_fake_mode():
    linear = torch.nn.Linear(4, 4)
    twin = copy.deepcopy(linear)
    assert twin.weight.fake_mode is mode and twin.bias.fake_mode is mode and twin.weight is not linear.weight
    assert twin(linear(torch.randn(2, 4))).shape == (2, 4)  # one mode: the two mix
assert "__deepcopy__" not in FakeTensorMode.__dict__  # torch's own behaviour back after the block
del linear, twin, mode
gc.collect()
assert not [o for o in gc.get_objects() if isinstance(o, FakeTensorMode)]
print("ok")
"""

NOTHING_FAKE_LEFT = """
import gc, os, sys, tempfile
os.environ["DSOPT_CACHE_DIR"] = tempfile.mkdtemp()  # a build, not a cached inventory
from launchers.trace.inventory import with_inventory
from optimizer.study.study_file import load_study
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

assert "peft" not in sys.modules  # the build imports it, as a dsopt process's first LoRA build does
study = with_inventory(load_study("studies/grid-lora-llama-cpu.yaml"))
assert study.model.inventory is not None and study.model.inventory.trainable_parameters > 0
gc.collect()
left = [o for o in gc.get_objects() if isinstance(o, (FakeTensor, FakeTensorMode))]
assert not left, [type(o).__name__ for o in left]
print("ok")
"""


def _in_a_process(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-3000:]


def test_a_deep_copy_gets_a_mode_of_its_own_until_made_one_of_the_traces():
    _in_a_process(BODY)


def test_a_deep_copy_in_the_block_keeps_its_mode_and_leaves_none_behind():
    """launchers/models/fake_kernels.py ``copies_keep_their_fake_mode``: the copy is the mode's, ops mix the two, and
    no second mode is left alive in the process (the suite's SIGSEGVs in fake dispatch came after such copies)."""
    _in_a_process(COPIES)


def test_a_peft_model_with_modules_to_save_is_traced():
    """PEFT's own ModulesToSaveWrapper on the LoRA study's Llama: the trace runs (it fell back to the formula with
    "Mixing fake modes NYI") and counts what trains as the inventory does (the head's copy included). The copy is
    the trace's own mode's (``copies_keep_their_fake_mode``): ``in_one_fake_mode`` finds nothing left to remake."""
    pytest.importorskip("peft")
    _in_a_process(PEFT_TRACE)


def test_a_lora_build_leaves_no_fake_tensor_or_mode_in_the_process():
    """PEFT imported for the first time inside the build's fake mode kept LoHa's import-time default tensors
    (``peft/tuners/loha/layer.py`` ``HadaWeight.forward``: ``scale=torch.tensor(1)``) fake, with their mode, for the
    life of the process; the build now imports what it needs first (``import_before_faking``)."""
    pytest.importorskip("peft")
    _in_a_process(NOTHING_FAKE_LEFT)
