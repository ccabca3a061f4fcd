"""What CPU kernels allocate that fake tensors do not: the promoted copies of a mixed-dtype pointwise op's inputs.

A pointwise op (``TensorIterator``) whose inputs differ in floating dtype computes in their common dtype. On CUDA the
kernel casts each element as it reads it; on the CPU ``TensorIteratorBase::compute_types`` first makes a temporary
copy of every input of another dtype (``aten/src/ATen/TensorIterator.cpp``, "Promotes inputs by creating temporaries
of the correct dtype", taken when the common device is the CPU), alive until the op returns. A fake tensor runs the
op's meta function only, so a trace misses those copies — and on CPU ranks they sit at the peak where a bf16 result
meets an fp32 one: PEFT's ``result + lora_B(lora_A(x)) * scaling`` with the adapters kept fp32 at ZeRO-3
(``peft/tuners/lora/layer.py``, a bf16 output plus an fp32 one), measured on 2 CPU ranks as one more output-sized
fp32 tensor live at the recomputation's peak (``torch.randn(…, dtype=bf16) + torch.randn(…)`` allocates an fp32
``_to_copy`` of the first beside the output, ``torch.profiler``).

:func:`cpu_promotion_copies` makes the same copies around each such op in a trace of a CPU-rank study
(``model_spec[CPU_KERNELS]``, :data:`optimizer.study.traced_activation.CPU_KERNELS`), below autograd (a dispatch
mode: what autograd saves is the op's own input, as on the CPU) and above the memory tracker, which sees them
allocated before the output and freed after it. GPU studies are traced without it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _promoted_copies(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The temporaries the CPU makes for one pointwise op: each non-scalar floating input not of the common dtype,
    cast to it (0-dim tensors are CPU scalars, read in place)."""
    tensors = [t for t in tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) < 2:
        return []
    common = functools.reduce(torch.promote_types, dtypes)
    return [t.to(common) for t in tensors if t.dtype != common]


class _CpuPromotionCopies(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.pointwise not in func.tags:
            return func(*args, **kwargs)
        copies = _promoted_copies(args, kwargs)  # live while the kernel runs, as TensorIterator's temporaries
        out = func(*args, **kwargs)
        del copies
        return out


@contextlib.contextmanager
def cpu_promotion_copies(enabled: bool = True) -> Iterator[None]:
    """The CPU's promoted input copies of mixed-dtype pointwise ops, made in the trace (module doc); nothing when
    not ``enabled``."""
    if not enabled:
        yield
        return
    with _CpuPromotionCopies():
        yield
