"""``torch.compile`` deferred to a function's first call while a library that compiles at import is imported.

``torch.compile`` compiles on a function's first call; only its imports are eager: it imports ``torch._dynamo`` and
``torch._inductor`` before it returns (torch 2.13 ``__init__.py``: ``_TorchCompileInductorWrapper``,
``get_compiler_fn``). Libraries that decorate kernels with it pay those imports whenever they are imported:

* bitsandbytes 0.50 (``backends/default/ops.py:12-35`` ``_try_torch_compile``, on ``_dequantize_blockwise_compute``
  and the 4-bit kernels), which PEFT 0.21 imports whenever it is installed (``peft/helpers.py:27-30``; 0.22 no
  longer does), so with it every ``import peft`` — a LoRA plan with no quantization too — imported the compiler:
  ~1.5 s of a 7B LoRA plan's ~13 s on 2 CPU cores (py-spy, docs/benchmarks.md "Where a plan's seconds go");
* DeepSpeed 0.19.8's Muon kernels (:mod:`launchers.process.lazy_compile`).

:func:`import_deferring_compile` imports a module with ``torch.compile`` standing as :func:`compiled_on_first_call`,
which calls the same ``torch.compile(fn, **options)`` on the function's first call and that compiled function ever
after. What runs is unchanged — the same kernels, compiled where they are first called as they were, bitsandbytes'
own fallback to the plain function where compiling fails (its wrapper catches the call's exception) — only the
compiler's import moves to that first call, which a plan (fake tensors, no bitsandbytes kernel run) never makes.
A module (``torch.compile(nn.Module)``) is compiled at once, as before: only plain functions are deferred.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

_swap = threading.RLock()
"""Held while ``torch.compile`` stands replaced (:func:`compile_deferred`): one window at a time."""
_real: list[Callable[..., Any]] = []
"""``torch.compile`` itself while a window is open (what a deferred kernel called inside one compiles with)."""


def compiled_on_first_call(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``fn`` compiled by ``torch.compile(fn, **options)`` when first called (torch's compiler imported then; the real
    ``torch.compile``, inside a :func:`compile_deferred` window too), that compiled function called from then on.
    Where making it raises, the plain ``fn`` is kept for later calls (as bitsandbytes keeps it when ``torch.compile``
    raises at its decoration) and the error goes to this first caller."""
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            import torch

            compile_ = _real[-1] if _real else torch.compile
            try:
                compiled.append(compile_(fn, **options))
            except Exception:
                compiled.append(fn)
                raise
        return compiled[0](*args, **kwargs)

    return call


@contextmanager
def compile_deferred() -> Iterator[None]:
    """``torch.compile`` replaced, while the block runs, by a stand-in that defers plain functions
    (:func:`compiled_on_first_call`, as a decorator too: ``torch.compile(**options)(fn)``) and compiles anything
    else at once; restored after. Windows do not interleave (a lock; a nested one on the same thread is a no-op)."""
    import torch

    with _swap:
        if _real:  # nested: the stand-in is already there
            yield
            return
        real = torch.compile

        def stand_in(model: Any = None, **options: Any) -> Any:
            if model is None:
                return lambda fn: stand_in(fn, **options)
            if inspect.isfunction(model):
                return compiled_on_first_call(model, **options)
            return real(model, **options)

        _real.append(real)
        torch.compile = stand_in  # type: ignore[assignment]
        try:
            yield
        finally:
            _real.pop()
            if torch.compile is stand_in:  # not replaced again meanwhile by someone else
                torch.compile = real


def import_deferring_compile(name: str) -> ModuleType:
    """``importlib.import_module(name)`` under :func:`compile_deferred` (the modules it imports the first time
    are decorated with deferred compiles; a module imported before keeps what it had)."""
    with compile_deferred():
        return importlib.import_module(name)
