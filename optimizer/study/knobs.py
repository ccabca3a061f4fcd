"""The knobs dsopt searches over, and one candidate: a value for each knob.

Knob names are used everywhere — CLI ``--set``, search spaces, study storage:
``zero_stage``, ``offload_optimizer``, ``offload_param``, ``precision``, ``checkpointing``,
``micro_batch_size``. A :class:`Candidate` only checks that each value is well-formed;
whether the *combination* is one DeepSpeed accepts is :mod:`optimizer.study.constraints`' job,
so an invalid combination is reported with its reason, never silently fixed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import IntEnum, StrEnum
from typing import Final


class ZeroStage(IntEnum):
    """ZeRO stage (Rajbhandari et al. 2020): what is partitioned over the data-parallel ranks."""

    DISABLED = 0
    """Plain data parallel: every rank holds everything."""
    OPTIMIZER = 1
    """Optimizer states (and FP32 master weights) partitioned."""
    GRADIENTS = 2
    """Also gradients partitioned."""
    PARAMETERS = 3
    """Also parameters partitioned; gathered layer by layer for compute."""


class OffloadDevice(StrEnum):
    """Where offloaded state lives (DeepSpeed ``offload_optimizer.device`` / ``offload_param.device``)."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class Precision(StrEnum):
    """Training precision: fp32, or bf16/fp16 mixed precision with FP32 master weights."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one parameter, gradient or activation element in this precision."""
        return 4 if self is Precision.FP32 else 2

    @property
    def torch_dtype_name(self) -> str:
        """The training dtype's name in torch (``float32``, ``bfloat16``, ``float16``)."""
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[self.value]


@dataclass(frozen=True, kw_only=True, slots=True)
class NoCheckpointing:
    """Keep every activation the backward pass needs."""

    def __str__(self) -> str:
        return "none"


@dataclass(frozen=True, kw_only=True, slots=True)
class FullCheckpointing:
    """Recompute every transformer block in backward; keep only each block's input."""

    def __str__(self) -> str:
        return "full"


@dataclass(frozen=True, kw_only=True, slots=True)
class EveryKCheckpointing:
    """Recompute every ``k``-th block (blocks k, 2k, 3k, … counted from 1); keep the rest.

    This is torchtitan's layer-level selective activation checkpointing with frequency ``k``
    (``activation_checkpoint.selective_ac_option = "k"``). ``every_1`` is spelled ``full``.
    """

    k: int
    """Checkpoint frequency in blocks, ≥ 2."""

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 2:
            raise ValueError(f"every_K needs an integer K >= 2 (every_1 is 'full'), got K={self.k!r}")

    def __str__(self) -> str:
        return f"every_{self.k}"


@dataclass(frozen=True, kw_only=True, slots=True)
class SelectiveCheckpointing:
    """Recompute only the attention core (QKᵀ, softmax, dropout, ·V) — Korthikanti et al. 2022, §4.2."""

    def __str__(self) -> str:
        return "selective"


Checkpointing = NoCheckpointing | FullCheckpointing | EveryKCheckpointing | SelectiveCheckpointing
"""Activation-checkpoint granularity: a small typed union, as torchtitan models it."""

_EVERY_K = re.compile(r"^every_([0-9]+)$")


def parse_checkpointing(text: str) -> Checkpointing:
    """Parse a checkpointing knob value: ``none``, ``full``, ``selective`` or ``every_K`` (K ≥ 2)."""
    if text == "none":
        return NoCheckpointing()
    if text == "full":
        return FullCheckpointing()
    if text == "selective":
        return SelectiveCheckpointing()
    match = _EVERY_K.match(text)
    if match:
        return EveryKCheckpointing(k=int(match.group(1)))
    raise ValueError(f"expected none, full, selective or every_K (K >= 2), got {text!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One point of the search: a value for every knob."""

    zero_stage: ZeroStage
    """ZeRO stage 0–3."""
    offload_optimizer: OffloadDevice
    """Where optimizer states (and master weights) live: none (the GPU), cpu or nvme."""
    offload_param: OffloadDevice
    """Where partitioned parameters live between uses (ZeRO-3 only): none, cpu or nvme."""
    precision: Precision
    """fp32, or bf16/fp16 mixed precision."""
    checkpointing: Checkpointing
    """Activation-checkpoint granularity."""
    micro_batch_size: int
    """Samples per GPU per forward/backward; gradient accumulation keeps the global batch fixed."""

    def __post_init__(self) -> None:
        if not isinstance(self.zero_stage, ZeroStage):
            raise ValueError(f"zero_stage must be a ZeroStage, got {self.zero_stage!r}")
        for name in ("offload_optimizer", "offload_param"):
            if not isinstance(getattr(self, name), OffloadDevice):
                raise ValueError(f"{name} must be an OffloadDevice, got {getattr(self, name)!r}")
        if not isinstance(self.precision, Precision):
            raise ValueError(f"precision must be a Precision, got {self.precision!r}")
        if not isinstance(self.checkpointing, Checkpointing):  # type: ignore[arg-type]
            raise ValueError(f"checkpointing must be a Checkpointing, got {self.checkpointing!r}")
        if isinstance(self.micro_batch_size, bool) or not isinstance(self.micro_batch_size, int):
            raise ValueError(f"micro_batch_size must be an integer, got {self.micro_batch_size!r}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")

    def knobs(self) -> dict[str, str | int]:
        """The candidate as knob name → plain value (the spelling used by ``--set`` and storage)."""
        return {
            "zero_stage": int(self.zero_stage),
            "offload_optimizer": self.offload_optimizer.value,
            "offload_param": self.offload_param.value,
            "precision": self.precision.value,
            "checkpointing": str(self.checkpointing),
            "micro_batch_size": self.micro_batch_size,
        }

    def label(self) -> str:
        """The candidate's one identity, e.g. ``z2 bf16 ckpt=full mbs=4 opt->cpu``: every knob, in a fixed order —
        the study's key for it (trial attribute ``label``: reuse, in-flight and "already measured"), what the
        progress lines, the ledger tables and the dashboard show, and (:meth:`folder_name`) its trial folder."""
        parts = [f"z{int(self.zero_stage)}", self.precision.value, f"ckpt={self.checkpointing}",
                 f"mbs={self.micro_batch_size}"]
        if self.offload_optimizer is not OffloadDevice.NONE:
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_param is not OffloadDevice.NONE:
            parts.append(f"param->{self.offload_param}")
        return " ".join(parts)

    def folder_name(self) -> str:
        """:meth:`label` as a folder name (a trial's files), e.g. ``z2_bf16_ckpt=full_mbs=4_opt-cpu``: the same
        identity, spaces as ``_`` and ``->`` as ``-``."""
        return self.label().replace(" ", "_").replace("->", "-")


KNOB_NAMES: Final[tuple[str, ...]] = (
    "zero_stage",
    "offload_optimizer",
    "offload_param",
    "precision",
    "checkpointing",
    "micro_batch_size",
)


def parse_knob(name: str, value: object) -> object:
    """Parse one knob value (from YAML or from ``--set name=value``) into its typed form.

    Raises ``KeyError`` for an unknown knob name and ``ValueError`` for a bad value.
    """
    if name not in KNOB_NAMES:
        raise KeyError(f"unknown knob {name!r}; knobs are {', '.join(KNOB_NAMES)}")
    text = str(value).strip().lower() if not isinstance(value, bool) else repr(value)
    if name == "zero_stage":
        if text not in {"0", "1", "2", "3"}:
            raise ValueError(f"expected 0, 1, 2 or 3, got {value!r}")
        return ZeroStage(int(text))
    if name in ("offload_optimizer", "offload_param"):
        try:
            return OffloadDevice(text)
        except ValueError:
            raise ValueError(f"expected none, cpu or nvme, got {value!r}") from None
    if name == "precision":
        try:
            return Precision(text)
        except ValueError:
            raise ValueError(f"expected fp32, bf16 or fp16, got {value!r}") from None
    if name == "checkpointing":
        return parse_checkpointing(text)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"expected a positive integer, got {value!r}")
    return int(text)


def with_knobs(base: Candidate, overrides: dict[str, object]) -> Candidate:
    """``base`` with the given knobs replaced; values are parsed with :func:`parse_knob`."""
    return replace(base, **{name: parse_knob(name, value) for name, value in overrides.items()})


def coerce_enums(spec: object, **kinds: type[StrEnum]) -> None:
    """Turn plain strings into the field's enum (frozen dataclass), or raise naming the field."""
    for name, kind in kinds.items():
        value = getattr(spec, name)
        try:
            object.__setattr__(spec, name, kind(value))
        except ValueError:
            allowed = ", ".join(member.value for member in kind)
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}") from None
