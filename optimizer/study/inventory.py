"""The parameter inventory: every parameter of the model as its code builds it, read off a meta-device build (pure).

A shape (layers, widths, heads) describes a GPT-2 or Llama block; a real model may carry more (Qwen2's q/k/v
biases, Gemma's tied head and GeGLU, Phi-3's fused projections, Mixtral's experts, a user's own module). So for
a ``transformers`` config or an entry point, :mod:`launchers.trace.inventory` builds the model on PyTorch's ``meta``
device (shapes and dtypes only, nothing allocated) and records each parameter once — its qualified name, shape,
dtype, the module that owns it and that module's class — and which names share one tensor (tied weights,
counted once, as ``model.num_parameters()`` and DeepSpeed count them). The ledger's model-state items take Ψ,
ZeRO-3's padded partition, the largest gathered module, the largest tensor and the persistent small parameters
from the inventory (:func:`optimizer.ledger.transformer.parameter_tensors`); the hand layout stays for studies given
by their shape alone, where it equals the inventory of dsopt's own GPT exactly (tested).

Each tensor says whether it trains (``requires_grad`` after the study's ``training.frozen`` and ``model.peft`` are
applied, :mod:`launchers.models.trainable`): DeepSpeed builds gradients, master weights and optimizer states for
the trainable ones only (``runtime/utils.py:815-825`` ``is_optimized_parameter``; ``stage_1_and_2.py:428-434``;
``stage3.py:726-745``), while it holds, casts and (at ZeRO-3) partitions every one (docs/ledger.md, "Trainable and
frozen").
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

INVENTORY_FORMAT = 3
"""Bumped when the recorded fields change (the cache key carries it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class InventoryTensor:
    """One parameter tensor of the built model (shared tensors appear once, under their first name)."""

    name: str
    """Qualified name, as ``named_parameters()`` gives it first (``model.layers.0.self_attn.q_proj.weight``)."""
    module: str
    """The module that owns it directly (ZeRO-3 gathers a module's own parameters together)."""
    module_type: str
    """That module's class name (``Linear``, ``Embedding``, ``LlamaRMSNorm``, ...)."""
    shape: tuple[int, ...]
    """Its shape."""
    dtype: str
    """Its dtype as built (``float32`` on the meta device unless the code asks for another)."""
    trainable: bool = True
    """It trains (``requires_grad``): gradients, master weights and optimizer states exist for it."""
    four_bit: bool = False
    """A weight transformers' bitsandbytes quantizer holds at 4 bits (``model.quantization``): frozen, its bytes
    those of :func:`optimizer.ledger.quantized.four_bit_bytes`."""
    adapter: bool = False
    """A PEFT adapter's own tensor (LoRA A/B, DoRA's magnitude): what ``get_peft_model`` upcasts to fp32 in a
    bf16/fp16 model (``autocast_adapter_dtype=True``, its default; ``peft/tuners/tuners_utils.py:2729-2750``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if any(n < 0 for n in self.shape):
            raise ValueError(f"{self.name}: negative dimension in {self.shape}")

    @property
    def numel(self) -> int:
        """Elements."""
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ParameterInventory:
    """Every parameter of one model, as built (see the module docstring).

    Compared and hashed by a digest of its content, computed once: the ledger's caches key on the model spec
    that holds it, and a 70B model has hundreds of tensors."""

    tensors: tuple[InventoryTensor, ...]
    """The distinct parameter tensors, in ``named_parameters()`` order."""
    tied: tuple[tuple[str, ...], ...] = ()
    """Groups of qualified names that share one tensor (the first name is the one in ``tensors``)."""
    model_class: str = ""
    """The built model's class (``LlamaForCausalLM``, ``GPT``, a user's class)."""
    source: str = ""
    """How it was taken, e.g. ``meta build: transformers 5.24.0 AutoModelForCausalLM.from_config``."""
    digest: str = field(default="", init=False, repr=False)
    """SHA-256 of :meth:`to_json` (set on construction)."""

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError("a parameter inventory needs at least one parameter")
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "digest", hashlib.sha256(text.encode()).hexdigest())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParameterInventory) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    @property
    def parameters(self) -> int:
        """Ψ: elements over the distinct tensors (tied weights once)."""
        return sum(t.numel for t in self.tensors)

    @property
    def trainable_parameters(self) -> int:
        """Ψₜ: elements of the tensors that train (PEFT's ``get_nb_trainable_parameters()[0]``)."""
        return sum(t.numel for t in self.tensors if t.trainable)

    @property
    def four_bit_parameters(self) -> int:
        """Elements of the weights held at 4 bits (0 without ``model.quantization``)."""
        return sum(t.numel for t in self.tensors if t.four_bit)

    @property
    def frozen_parameters(self) -> int:
        """Ψ − Ψₜ: elements of the tensors that do not train."""
        return self.parameters - self.trainable_parameters

    def by_module(self) -> dict[str, int]:
        """Elements each module owns directly."""
        out: dict[str, int] = defaultdict(int)
        for tensor in self.tensors:
            out[tensor.module] += tensor.numel
        return dict(out)

    def largest_module(self) -> tuple[str, int]:
        """(name, elements) of the module with the most parameters of its own: what ZeRO-3 gathers at once."""
        return max(self.by_module().items(), key=lambda item: (item[1], item[0]))

    def by_module_type(self) -> list[tuple[str, int, int]]:
        """(module class, tensors, elements), the largest share first."""
        count: dict[str, int] = defaultdict(int)
        elements: dict[str, int] = defaultdict(int)
        for tensor in self.tensors:
            count[tensor.module_type] += 1
            elements[tensor.module_type] += tensor.numel
        return sorted(((k, count[k], elements[k]) for k in count), key=lambda row: (-row[2], row[0]))

    def summary_lines(self) -> list[str]:
        """What ``dsopt ledger`` prints beside the ledger: Ψ, parameters by module type, the largest gathered
        module and the tied groups."""
        psi = self.parameters
        name, largest = self.largest_module()
        lines = [f"Parameter inventory ({self.source or 'meta build'}): {self.model_class or 'model'}, "
                 f"Ψ = {psi:,} in {len(self.tensors):,} tensors"]
        for module_type, tensors, elements in self.by_module_type():
            lines.append(f"  {module_type:<28} {tensors:>7,} tensors {elements:>18,} ({elements / psi:6.1%})")
        lines.append(f"  largest module (ZeRO-3 gathers it whole): {name} — {largest:,} elements")
        trainable = self.trainable_parameters
        if trainable != psi:
            lines.append(f"  trainable Ψₜ = {trainable:,} ({trainable / psi:.3%}) in "
                         f"{sum(t.trainable for t in self.tensors):,} tensors; frozen {psi - trainable:,}")
        four_bit = self.four_bit_parameters
        if four_bit:
            lines.append(f"  4-bit (QLoRA base) {four_bit:,} ({four_bit / psi:.3%}) in "
                         f"{sum(t.four_bit for t in self.tensors):,} tensors")
        lines.extend(f"  tied: {' = '.join(group)}" for group in self.tied)
        if not self.tied:
            lines.append("  tied: none")
        return lines

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the inventory cache's entry)."""
        return {"format": INVENTORY_FORMAT, "model_class": self.model_class, "source": self.source,
                "tied": [list(group) for group in self.tied],
                "tensors": [[t.name, t.module, t.module_type, list(t.shape), t.dtype, t.trainable,
                             *([t.four_bit, True] if t.adapter else [True] if t.four_bit else [])]
                            for t in self.tensors]}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> ParameterInventory:
        """The inventory of :meth:`to_json`'s dict (ValueError when it is not one of this format)."""
        if data.get("format") != INVENTORY_FORMAT:
            raise ValueError(f"inventory format {data.get('format')!r}, expected {INVENTORY_FORMAT}")
        tensors = tuple(InventoryTensor(name=n, module=m, module_type=t, shape=tuple(s), dtype=d, trainable=bool(r),
                                        four_bit=bool(q and q[0]), adapter=bool(q[1:] and q[1]))
                        for n, m, t, s, d, r, *q in data["tensors"])
        return ParameterInventory(tensors=tensors, tied=tuple(tuple(g) for g in data.get("tied", ())),
                                  model_class=str(data.get("model_class", "")), source=str(data.get("source", "")))


def inventory_key(model_spec: Mapping[str, Any], *, versions: Mapping[str, str | None],
                  sequence_length: int | None = None) -> str:
    """The cache key of a model's inventory: its spec (what the ranks build), the code that builds it
    (``versions``: the libraries' versions and source digests) and ``sequence_length`` where the build is given it
    (an entry point is called with it; None otherwise) — content only, nothing that names where a study sits."""
    return json.dumps({"model": dict(model_spec), "versions": dict(versions), "sequence_length": sequence_length,
                       "format": INVENTORY_FORMAT}, sort_keys=True, separators=(",", ":"))
