"""How a trial builds its model — the way the training script it stands for would — and seeds its weights.

Three constructions (``training.model_init``, resolved per ZeRO stage by
:func:`optimizer.study.specs.construction_for`):

* ``zero_init`` — under ``deepspeed.zero.Init(config_dict_or_path=ds_config)``: tensors are created on the
  rank's device in the config's dtype (``partition_parameters.py:397-407``, the patched constructors at
  ``:640-660``) and each module's own parameters are broadcast from rank 0 and partitioned as soon as its
  ``__init__`` returns (``:1232-1262``, ``_zero_init_param`` ``:1199-1207``); the partition lives on
  ``offload_param.device`` when the config offloads parameters (``:1157-1169``). A ``transformers`` model is
  built the way Hugging Face's Trainer builds it: an ``HfDeepSpeedConfig`` of the trial's config is alive
  while ``from_config`` runs, so the library enters ``zero.Init`` itself (``modeling_utils.py``
  ``_from_config``) — no rank ever holds the whole model;
* ``device`` — directly on the rank's device in the training dtype (``torch.device`` and the default dtype,
  as ``from_config(dtype=...)`` does); DeepSpeed makes the FP32 master weights from it;
* ``full`` — the whole model in FP32 on the host; DeepSpeed casts and moves it (``engine.py:2080-2094``).

A user's entry point is called inside the same context, so ``model.entry_point`` functions need no
DeepSpeed code of their own: under ``zero_init`` their modules are partitioned as they are built. Weights
they initialise *after* construction must be gathered first (``deepspeed.zero.GatheredParameters(...,
modifier_rank=0)``), as ``transformers`` does — or be initialised in each module's own ``__init__``.

**Seeded weights, identical on every path.** For the built-in GPT and ``transformers`` models, every
``nn.Linear`` and ``nn.Embedding`` weight is drawn N(0, std²) from a generator seeded by (seed, the
parameter's qualified name) on the parameter's device, in FP32, then copied into the parameter (cast to
its dtype); biases are zeroed, an embedding's padding row too. The draw depends neither on construction
order nor on partitioning, so the FP32 reference and a ZeRO-3 bf16 candidate start from the same values
(the bf16 one rounded, exactly as DeepSpeed's own cast rounds them). Under ``zero_init`` each module's
parameters are gathered for the draw and re-partitioned (``GatheredParameters``, rank 0's values
broadcast). Other parameters (norm weights and biases) keep their constructors' values: constants in
the built-in GPT and in every ``transformers`` decoder.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

GPT_INIT_STD = 0.02
"""GPT-2's initialisation: weights N(0, 0.02²), biases zero (Radford et al. 2019; nanoGPT)."""


def training_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    """The dtype DeepSpeed trains in under ``ds_config``: bf16, fp16 or fp32."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch.set_default_dtype`` for the block, restored after (transformers' ``local_torch_dtype``)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def construction_context(construction: str, *, ds_config: dict[str, Any], device: torch.device,
                         hf: bool) -> Iterator[None]:
    """The context a model of ``construction`` is built in (see the module docstring).

    ``hf``: the model is a ``transformers`` one, which enters ``zero.Init`` itself once an
    ``HfDeepSpeedConfig`` exists; the config object is kept alive for the block, as the Trainer keeps it.
    """
    if construction == "zero_init":
        if hf:
            from transformers.integrations import HfDeepSpeedConfig

            keep_alive = HfDeepSpeedConfig(ds_config)
            try:
                yield
            finally:
                del keep_alive
            return
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            yield
        return
    if construction == "device":
        with torch.device(device), default_dtype(training_dtype(ds_config)):
            yield
        return
    if construction == "full":  # no context: what the script around it set stays (an entry point's inner build)
        yield
        return
    raise ValueError(f"unknown construction {construction!r}: expected zero_init, device or full")


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    key = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)
    return torch.Generator(device=device).manual_seed(key)


def _gathered(params: list[nn.Parameter]) -> contextlib.AbstractContextManager[Any]:
    """Gather ZeRO-3 partitioned parameters for writing (rank 0's values are broadcast on exit)."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


INIT_CHUNK_ELEMENTS = 1 << 18
"""Elements drawn at a time: a 16-bit parameter's FP32 draw costs at most 1 MiB beside the model."""


@torch.no_grad()
def _draw_(weight: torch.Tensor, *, std: float, generator: torch.Generator) -> None:
    """Fill ``weight`` with N(0, std²) drawn in FP32, ``INIT_CHUNK_ELEMENTS`` at a time (the same draws in
    every dtype: an FP32 parameter is drawn in place, a 16-bit one through an FP32 chunk it is rounded from)."""
    flat = weight.view(-1)
    for start in range(0, flat.numel(), INIT_CHUNK_ELEMENTS):
        part = flat[start:start + INIT_CHUNK_ELEMENTS]
        if part.dtype == torch.float32:
            part.normal_(0.0, std, generator=generator)
        else:  # new_empty, not torch.empty: zero.Init patches torch.empty to its dtype (partition_parameters.py:652)
            part.copy_(part.new_empty(part.shape, dtype=torch.float32).normal_(0.0, std, generator=generator))


@torch.no_grad()
def seeded_init_(model: nn.Module, *, seed: int, std: float) -> None:
    """Draw every Linear/Embedding weight — and transformers' ``Conv1D`` (GPT-2's projections, a Linear stored
    transposed) — from (seed, its name); zero biases and padding rows (in place). Conv1D was left at the
    library's own init until issue 36: its draws depend on the construction (``zero.Init`` consumes the global
    generator otherwise), so a GPT-2 candidate and its zero.Init FP32 reference started from different weights."""
    for module_name, module in model.named_modules():
        conv1d = type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), nn.Parameter)
        if not (isinstance(module, nn.Linear | nn.Embedding) or conv1d):
            continue
        own = [p for p in (module.weight, getattr(module, "bias", None)) if p is not None]
        with _gathered(own):
            weight = module.weight
            _draw_(weight, std=std, generator=_generator(seed, f"{module_name}.weight", weight.device))
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                weight[module.padding_idx].zero_()
            if (isinstance(module, nn.Linear) or conv1d) and getattr(module, "bias", None) is not None:
                module.bias.zero_()
