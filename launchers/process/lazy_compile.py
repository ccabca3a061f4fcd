"""DeepSpeed's Muon kernels compiled on their first call, not when the engine is built: a dsopt rank's imports.

DeepSpeed 0.19.8 imports its Muon optimizer module whenever a ZeRO engine is built — to ask
``isinstance(optimizer, MuonWithAuxAdam)`` in ``runtime/zero/utils.py:66-76`` (``is_zero_supported_optimizer``, from
``engine.py:2298``), ``runtime/zero/stage3.py:355``, ``runtime/zero/stage_1_and_2.py:1592`` and
``runtime/bf16_optimizer.py:57``. That module's three kernels are decorated with ``@compiler.compile()``
(``runtime/zero/muon/original_muon.py:50, 81, 189``), which is ``torch.compile(fn)`` at import time
(``runtime/compiler.py:125-129``), and ``torch.compile`` imports ``torch._dynamo`` and ``torch._inductor`` before it
returns (torch 2.13 ``__init__.py``: ``get_default_backend``, ``_TorchCompileInductorWrapper``). Measured on a 2-core
CPU machine: 3.7 s per rank, about a quarter of a small trial's launch (docs/trials.md, "No compiler imported"),
spent on kernels that run only when the optimizer is Muon — never in dsopt's own trial, whose optimizer is the
study's Adam/AdamW.

``torch.compile`` itself compiles on the first call; only its imports are eager. :func:`install` (run by
:mod:`launchers.rank.trial_rank` after importing DeepSpeed) makes ``deepspeed.runtime.compiler.compile()`` — used by
those three decorators and nowhere else in DeepSpeed 0.19.8 — return
:func:`~launchers.models.deferred_compile.compiled_on_first_call`, which calls the
same ``torch.compile(fn)`` on the function's first call and that compiled function ever after. Nothing else changes:
no tensor is allocated by those imports (checked with the live-tensor counter of
:mod:`launchers.measure.cpu_memory`), so the measured peaks are the same; the trial's ``init_s`` no longer holds
those seconds (a run without dsopt pays them once, at its engine's init). A user's script trial is its own program:
its DeepSpeed is left as it is.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from launchers.models.deferred_compile import compiled_on_first_call

MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"
"""The module whose kernels DeepSpeed decorates with ``compiler.compile()`` (module doc)."""


def _compile() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``deepspeed.runtime.compiler.compile``'s stand-in: the decorator :func:`compiled_on_first_call`."""
    return compiled_on_first_call


def install() -> bool:
    """Replace ``deepspeed.runtime.compiler.compile`` (module doc) before DeepSpeed's Muon module is imported; False
    where it was imported already (its kernels are compiled as DeepSpeed decorated them) or DeepSpeed has no such
    function."""
    if MUON_MODULE in sys.modules:
        return False
    from deepspeed.runtime import compiler

    if not callable(getattr(compiler, "compile", None)):
        return False
    compiler.compile = _compile
    return True
