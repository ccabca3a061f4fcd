"""The ZeRO-3 run's linear in the traces (launchers/models/zero3_linear.py): it saves what DeepSpeed's own
``LinearFunctionForZeroStage3`` saves, DeepSpeed really leaves it in place after ``zero.Init``, and the ledger
takes the ZeRO-3 trace only for a ZeRO-3 candidate of a model that trains in part."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from launchers.models.zero3_linear import _zero3_linear, deepspeed_linear
from launchers.trace.study_traces import needed_traces
from optimizer.study.knobs import Precision
from optimizer.study.study_file import load_study
from optimizer.study.traced_activation import TracedActivation

ROOT = Path(__file__).resolve().parents[3]


def _saved(fn, *, weight_trains: bool, bias: bool, dims: int) -> tuple[list[int], list[torch.Tensor]]:
    """Bytes of each tensor ``fn`` saves for backward, and (output, input grad, weight grad) of a fixed draw."""
    torch.manual_seed(0)
    x = torch.randn(*(3, 5, 8)[3 - dims:], requires_grad=True)
    w = torch.randn(6, 8, requires_grad=weight_trains)
    b = torch.randn(6, requires_grad=weight_trains) if bias else None
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x * 1.0, w, b)
    y.square().sum().backward()
    return sorted(sizes), [y.detach(), x.grad, w.grad if weight_trains else torch.zeros(())]


@pytest.mark.parametrize("weight_trains", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dims", [2, 3])
def test_the_copy_saves_and_computes_what_deepspeeds_linear_does(weight_trains, bias, dims, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    ours, ours_out = _saved(_zero3_linear, weight_trains=weight_trains, bias=bias, dims=dims)
    theirs, theirs_out = _saved(zero3_linear_wrap, weight_trains=weight_trains, bias=bias, dims=dims)
    assert ours == theirs
    for a, b in zip(ours_out, theirs_out, strict=True):
        torch.testing.assert_close(a, b)
    plain, _ = _saved(F.linear, weight_trains=weight_trains, bias=bias, dims=dims)
    if not weight_trains:  # autograd's own linear keeps a frozen Linear's weight only; DeepSpeed's its input too
        assert sum(theirs) - sum(plain) >= 5 * 8 * 4 * (3 if dims == 3 else 1)


def test_the_patch_is_undone_on_exit():
    before = torch.nn.functional.linear
    with deepspeed_linear():
        assert torch.nn.functional.linear is _zero3_linear
    assert torch.nn.functional.linear is before


@pytest.mark.slow  # a DeepSpeed import and zero.Init in a subprocess (seconds)
def test_zero_init_leaves_deepspeeds_linear_in_place():
    """The premise (partition_parameters.py:412-419, 'This will persist unless manually reset'): after a model is
    built under zero.Init, every later F.linear — the training's forward and backward — is DeepSpeed's."""
    script = textwrap.dedent("""
        import torch, deepspeed
        from deepspeed.runtime.zero.linear import zero3_linear_wrap
        deepspeed.init_distributed(dist_backend="gloo")
        with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1,
                                                      "zero_optimization": {"stage": 3}}):
            torch.nn.Linear(8, 8)
        print(torch.nn.functional.linear is zero3_linear_wrap)
    """)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29571", "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"


def _entry(zero3_run: bool, peak: int) -> TracedActivation:
    return TracedActivation(checkpointing="none", precision=Precision.BF16, points=((2, peak),), zero3_run=zero3_run)


# a QLoRA base too: transformers builds it without zero.Init, but deepspeed.initialize converts it with
# Init(module=...), which wraps F.linear for good (partition_parameters.py:1090-1091)
@pytest.mark.parametrize("study_name, adapted", [("grid-lora-llama-cpu", True), ("grid-qlora-llama-cpu", True),
                                                 ("grid-llama-cpu", False)])
def test_the_zero3_trace_is_taken_for_a_zero3_candidate_of_a_model_that_trains_in_part(study_name, adapted):
    study = load_study(ROOT / "studies" / f"{study_name}.yaml")
    assert study.model.adapted is adapted
    plain, zero3 = _entry(False, 100), _entry(True, 150)
    model = dataclasses.replace(study.model, traced_activations=(plain, zero3))
    assert model.traced_for("none", Precision.BF16, zero3=False) is plain
    assert model.traced_for("none", Precision.BF16, zero3=True) is (zero3 if adapted else plain)
    only_plain = dataclasses.replace(study.model, traced_activations=(plain,))
    assert only_plain.traced_for("none", Precision.BF16, zero3=True) is plain  # a table without it: as before
    runs = {zero3_run for (_, _, zero3_run) in needed_traces(study)}
    assert runs == ({False, True} if adapted else {False})
    no_stage3 = dataclasses.replace(study, search_space=dataclasses.replace(
        study.search_space, values=tuple((k, (0, 1, 2) if k == "zero_stage" else v)
                                         for k, v in study.search_space.values)))
    assert {zero3_run for (_, _, zero3_run) in needed_traces(no_stage3)} == {False}
