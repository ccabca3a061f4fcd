"""Fake-tensor stand-ins for kernels whose meta implementation refuses what the real kernel runs.

``torch.nn.functional.grouped_mm`` — how ``transformers`` ≥ 5 runs MoE experts (``integrations/moe.py``,
``grouped_mm_experts_forward``: every token's top-k rows sorted by expert and multiplied in one grouped matmul)
— has a CPU kernel for FP32 and FP16 since torch 2.9, but its meta function (``torch/_meta_registrations.py``,
``_meta_grouped_mm_common``) insists on BF16 inputs, so an FP32 trace of Mixtral stops there although the
real trial runs. Inside a trace, :func:`grouped_mm_for_fake_tensors` replaces it for non-BF16 inputs with an
autograd function of the same memory: the output ``(rows, N)`` in the input's dtype, the inputs saved for
backward (as ``aten._grouped_mm``'s derivative saves ``self`` and ``mat2``), gradients shaped like them.
BF16 inputs keep the library's own function.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

GROUPED_NOTE = ("MoE experts traced as transformers runs them (grouped_mm over every token's top-k rows): the "
                "memory does not depend on the routing")
"""Stated with every trace that ran a grouped matmul."""


class _GroupedMatmul(torch.autograd.Function):
    """``(S, K) @ grouped (E, K, N) -> (S, N)``: shapes and saved tensors only (module doc)."""

    @staticmethod
    def forward(ctx: Any, mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mat_a, mat_b)
        return mat_a.new_empty((mat_a.shape[0], mat_b.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        mat_a, mat_b = ctx.saved_tensors
        return torch.empty_like(mat_a), torch.empty_like(mat_b), None


@contextlib.contextmanager
def grouped_mm_for_fake_tensors(seen: list[str]) -> Iterator[None]:
    """Within the block, non-BF16 2-D × 3-D grouped matmuls run :class:`_GroupedMatmul`; each call (either
    path) appends :data:`GROUPED_NOTE` to ``seen`` once."""
    functional = torch.nn.functional
    original = getattr(functional, "grouped_mm", None)
    if original is None:
        yield
        return

    def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *, offs: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if GROUPED_NOTE not in seen:
            seen.append(GROUPED_NOTE)
        if mat_a.dtype is torch.bfloat16 or offs is None or bias is not None or out_dtype is not None \
                or mat_a.dim() != 2 or mat_b.dim() != 3:
            return original(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
        return _GroupedMatmul.apply(mat_a, mat_b, offs)

    functional.grouped_mm = grouped_mm
    try:
        yield
    finally:
        functional.grouped_mm = original


LAZY_IMPORTS = (("peft", "peft"), ("peft", "bitsandbytes"), ("quantization", "bitsandbytes"))
"""(model_spec key, module): the libraries a model build imports lazily when the spec uses them. PEFT's adapters
import bitsandbytes where it is installed, 4-bit or not (peft 0.22, ``import_utils.py:91``
``is_bnb_4bit_available``), whose import makes its 4-bit code tables (``bitsandbytes/backends/utils.py``)."""


def import_before_faking(model_spec: Mapping[str, Any]) -> None:
    """Import, outside any fake mode, what ``model_spec``'s build would import lazily inside one. A module first
    imported under ``FakeTensorMode`` makes the tensors it creates at import fake, and keeps them and their mode for
    the life of the process: PEFT 0.21's LoHa defaults ``scale=torch.tensor(1)`` (``peft/tuners/loha/layer.py``
    ``HadaWeight.forward``, ``HadaWeightCP.forward``), imported with ``peft`` by the first LoRA build; bitsandbytes'
    4-bit code tables, imported by PEFT 0.22's LoRA build. A library that is not installed is left to the build to
    report."""
    for key, module in LAZY_IMPORTS:
        if model_spec.get(key):
            with contextlib.suppress(ImportError):
                importlib.import_module(module)


def _the_same_mode(mode: Any, _memo: dict[int, Any]) -> Any:
    return mode


@contextlib.contextmanager
def copies_keep_their_fake_mode() -> Iterator[None]:
    """Within the block a deep copy of a fake tensor keeps the fake mode it was made in. ``copy.deepcopy`` of a
    ``FakeTensor`` — PEFT's ``modules_to_save`` (``peft/utils/other.py``, ``ModulesToSaveWrapper``), TRL's reference
    copy — copies the tensor's ``__dict__`` and with it its ``fake_mode`` (torch 2.13, ``_tensor.py``
    ``Tensor.__deepcopy__``): a second ``FakeTensorMode``, a field-by-field copy of the first's caches and tensor
    converter, left alive in the process. An op cannot mix the two ("Mixing fake modes NYI"), and after such copies
    torch's fake dispatch crashed the suite's process with SIGSEGV (``_cached_dispatch_impl``; docs/benchmarks.md,
    "The suite"; twice in ``tests/optimizer/study/test_trainable.py``, the build after a ``modules_to_save`` one). A
    mode is a context, not a value: here its copies are itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    missing = object()
    before = FakeTensorMode.__dict__.get("__deepcopy__", missing)
    FakeTensorMode.__deepcopy__ = _the_same_mode  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if before is missing:
            del FakeTensorMode.__deepcopy__
        else:
            FakeTensorMode.__deepcopy__ = before  # type: ignore[attr-defined]


def in_one_fake_mode(model: torch.nn.Module, mode: Any) -> int:
    """Make every fake parameter and buffer of ``model`` one of ``mode``'s (shape, strides, dtype, device and
    ``requires_grad`` kept, a shared tensor remade once); returns how many were remade. PEFT's ``modules_to_save``
    deep-copies the module it trains (``peft/utils/other.py``, ``ModulesToSaveWrapper``), and a fake tensor's deep
    copy gets a fake mode of its own (torch 2.13, in or out of the first mode), which an op cannot mix with the
    trace's ("Mixing fake modes NYI").
    Call it inside ``mode``."""
    from torch._subclasses.fake_tensor import FakeTensor

    remade: dict[int, torch.Tensor] = {}  # one new tensor per old one: a tensor shared in the copy stays shared
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in list(store.items()):
                if isinstance(tensor, FakeTensor) and tensor.fake_mode is not mode:
                    if id(tensor) not in remade:
                        fresh = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                                    device=tensor.device)
                        is_parameter = isinstance(tensor, torch.nn.Parameter)
                        remade[id(tensor)] = torch.nn.Parameter(fresh, tensor.requires_grad) if is_parameter else fresh
                    store[name] = remade[id(tensor)]
    return len(remade)
