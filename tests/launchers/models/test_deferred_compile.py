"""``torch.compile`` deferred to a function's first call while a library is imported (launchers/models/
deferred_compile.py): PEFT and bitsandbytes import without ``torch._inductor``'s compiler, against a control that
does, and what a deferred kernel computes is what ``torch.compile`` gave."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from launchers.models.deferred_compile import compile_deferred, compiled_on_first_call

ROOT = Path(__file__).resolve().parents[3]


def test_a_kernel_is_compiled_by_torch_compile_with_its_options_on_its_first_call_only(monkeypatch):
    compiled: list[tuple[object, dict]] = []

    def spy_compile(fn, **options):  # torch.compile's own work is torch's; what it is given and when is ours
        compiled.append((fn, options))
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    def kernel(x, *, scale):
        """A kernel's own docstring."""
        return x * scale

    monkeypatch.setattr(torch, "compile", spy_compile)
    lazy = compiled_on_first_call(kernel, dynamic=False)
    assert compiled == [] and lazy.__doc__ == kernel.__doc__ and lazy.__wrapped__ is kernel
    assert lazy(3, scale=2) == ("compiled", 6)
    assert lazy(4, scale=1) == ("compiled", 4)
    assert compiled == [(kernel, {"dynamic": False})]  # compiled once, the compiled function called both times


def test_under_the_block_functions_are_deferred_modules_compiled_at_once_and_torch_compile_is_restored(monkeypatch):
    calls: list[tuple[object, dict]] = []

    def spy_compile(model=None, **options):
        calls.append((model, options))
        return model

    monkeypatch.setattr(torch, "compile", spy_compile)

    def kernel(x):
        return x + 1

    module = nn.Linear(2, 2)
    with compile_deferred():
        as_call = torch.compile(kernel, dynamic=False)
        as_decorator = torch.compile(dynamic=True)(kernel)
        bare = torch.compile(kernel)
        assert torch.compile(module, mode="default") is module  # compiled at once, as before
    assert torch.compile is spy_compile and calls == [(module, {"mode": "default"})]
    assert (as_call(1), as_decorator(2), bare(3)) == (2, 3, 4)
    assert calls[1:] == [(kernel, {"dynamic": False}), (kernel, {"dynamic": True}), (kernel, {})]


def _fresh(code: str) -> dict:
    """What ``code`` (a fresh interpreter) printed as its last line, as JSON."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("library", ["peft", "bitsandbytes"])
def test_peft_and_bitsandbytes_import_without_torchs_compiler_and_dequantize_as_before(library):
    pytest.importorskip(library)
    pytest.importorskip("bitsandbytes")
    code = """
        import json, sys
        import torch
        from launchers.models.deferred_compile import import_deferring_compile
        import_deferring_compile(LIBRARY) if DEFER else __import__(LIBRARY)
        inductor = "torch._inductor.compile_fx" in sys.modules  # torch.compile's backend (transformers' masking
        # utilities import torch._dynamo, which imports the package torch._inductor itself)
        eager = "bitsandbytes" in sys.modules  # PEFT 0.21 imports it with itself (peft/helpers.py), 0.22 does not
        import bitsandbytes.functional as F
        torch.manual_seed(0)
        weight = torch.randn(64, 64, dtype=torch.bfloat16)
        packed, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4")
        back = F.dequantize_4bit(packed, state)  # bitsandbytes' compiled dequantization, on CPU
        err = float((back - weight).abs().max())
        print(json.dumps({"inductor": inductor, "eager": eager, "sum": float(back.float().sum()), "err": err}))
        """.replace("LIBRARY", repr(library))
    control = _fresh(code.replace("DEFER", "False"))
    assert control["inductor"] or not control["eager"]  # bitsandbytes' decorators import the compiler as they are
    assert control["eager"] or library == "peft"  # importing bitsandbytes imports it
    deferred = _fresh(code.replace("DEFER", "True"))
    assert not deferred["inductor"]
    assert deferred["sum"] == control["sum"] and deferred["err"] == control["err"] < 0.5


def test_a_kernel_whose_compile_raises_runs_plain_after_the_first_call(monkeypatch):
    tries: list[object] = []

    def failing_compile(fn, **options):
        tries.append(fn)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", failing_compile)
    lazy = compiled_on_first_call(lambda x: x * 2)
    with pytest.raises(RuntimeError, match="no compiler"):  # bitsandbytes' wrapper catches it and runs the plain one
        lazy(1)
    assert lazy(2) == 4 and lazy(3) == 6 and len(tries) == 1  # not tried again


def test_a_kernel_first_called_inside_a_window_compiles_with_the_real_torch_compile(monkeypatch):
    calls: list[object] = []

    def spy_compile(model=None, **options):
        calls.append(model)
        return model

    monkeypatch.setattr(torch, "compile", spy_compile)

    def kernel(x):
        return x - 1

    with compile_deferred():
        lazy = torch.compile(kernel)
        with compile_deferred():  # nested: the same window
            assert lazy(5) == 4
    assert calls == [kernel] and torch.compile is spy_compile
