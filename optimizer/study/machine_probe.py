"""The probe of the machine's own kernels: what one run of ``dsopt probe`` measured (pure values and JSON).

A probe times, on the study's own ranks and at the study's own shapes, the operations its candidates run
(:mod:`optimizer.perf.probe_plan` says which; :mod:`launchers.rank.probe_rank` times them): the model's GEMMs and
attention in each precision at each micro-batch, the optimizer step on the device and DeepSpeedCPUAdam's on the
host, host↔device copies, the collectives across the ranks, NVMe reads and writes, and DeepSpeed's engine's own
cost per micro-step at each ZeRO stage. Each figure keeps its
spread: every rank times ``repeats`` rounds; a figure's ``median_s`` is the slowest rank's median (a step waits
for its slowest rank), ``low_s``/``high_s`` the fastest and slowest round on any rank.

The time model reads the figures through :func:`optimizer.perf.probe_plan.probe_rates`; the figures are attached to
the study's hardware (:attr:`optimizer.study.specs.HardwareSpec.probe`) by :mod:`launchers.probe.machine`, like
the parameter inventory is to the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PROBE_FORMAT = 1
"""Bumped when the recorded fields change (the cache key carries it)."""

KINDS = ("gemm", "attention", "device_adam", "host_adam", "copy", "memory", "all_reduce", "reduce_scatter",
         "all_gather", "nvme_write", "nvme_read", "engine_micro", "engine_step", "pass")
"""What a figure times (module doc): ``gemm`` and ``attention`` forward + backward of the model's matmuls and
attention core at one precision and micro-batch (work: FLOPs); ``device_adam``/``host_adam`` one optimizer step
(work: parameters); ``copy`` host↔device (CPU ranks: host memory to host memory; work: bytes); ``memory`` a
device-memory copy (work: bytes read + written); the collectives (work: bytes of the buffer); NVMe (work: bytes);
``engine_micro`` a micro-step of DeepSpeed's engine that only accumulates and ``engine_step`` one that also steps
the optimizer, on the study's model at a tiny width (:mod:`optimizer.perf.skeleton`; variant: the ZeRO stage,
``z2``; work: 1 micro-step); ``pass`` the study's model's own forward and backward at its width, at most two blocks
deep, at one precision and micro-batch (variant ``intercept``: one row of the skeleton's tokens;
:mod:`optimizer.perf.model_pass`; work: its FLOPs as the time model counts them, :attr:`ProbeFigure.terms` by
feature)."""

PASS_INTERCEPT = "intercept"
"""The variant of a ``pass`` figure timed on one row of the skeleton's tokens: the per-call cost of the pass's modules
(:mod:`optimizer.perf.model_pass`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeFigure:
    """One timed operation and its spread."""

    kind: str
    """One of :data:`KINDS`."""
    precision: str = ""
    """Training precision of a ``gemm``/``attention``/``engine_*`` figure (``fp32``, ``bf16``, ``fp16``); empty
    otherwise."""
    micro_batch: int = 0
    """Micro-batch size of a ``gemm``/``attention`` figure; 0 otherwise."""
    variant: str = ""
    """``pinned``/``pageable`` for ``copy``, ``h2d``/``d2h`` appended (``pinned h2d``); a collective's size
    (``8192 B``); an engine's stage (``z2``); an engine's with every block
    checkpointed (``z0 ckpt=full``); a pass's ``intercept``; empty otherwise."""
    work: float
    """What one run does, in the kind's unit (FLOPs, parameters or bytes; :data:`KINDS`)."""
    median_s: float
    """Seconds of one run: the slowest rank's median over its rounds."""
    low_s: float
    """The fastest round on any rank (seconds)."""
    high_s: float
    """The slowest round on any rank (seconds)."""
    repeats: int
    """Rounds per rank."""
    terms: tuple[tuple[str, float], ...] = ()
    """A ``pass`` figure's work by the time model's feature (``flops_fp32``, ``flops_16bit``, ``dequant_bytes``:
    :func:`optimizer.perf.model_pass.pass_terms`); empty for the other kinds."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"probe figure kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not (0 < self.low_s <= self.median_s <= self.high_s) or self.work <= 0 or self.repeats < 1:
            raise ValueError(f"probe figure {self.kind}: need 0 < low <= median <= high, work > 0 and repeats "
                             f">= 1, got {self.low_s}, {self.median_s}, {self.high_s}, {self.work}, {self.repeats}")

    @property
    def seconds_per_unit(self) -> float:
        """Median seconds per unit of work (per FLOP, parameter or byte)."""
        return self.median_s / self.work

    @property
    def spread(self) -> float:
        """(high − low) / median: how far the rounds strayed, relative."""
        return (self.high_s - self.low_s) / self.median_s

    def label(self) -> str:
        """What it timed, in a few words (``gemm bf16 mbs=4``, ``copy pinned h2d``, ``all_reduce``)."""
        parts = [self.kind, self.precision, f"mbs={self.micro_batch}" if self.micro_batch else "", self.variant]
        return " ".join(p for p in parts if p)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "precision": self.precision, "micro_batch": self.micro_batch,
                "variant": self.variant, "work": self.work, "median_s": self.median_s, "low_s": self.low_s,
                "high_s": self.high_s, "repeats": self.repeats,
                **({"terms": [[name, amount] for name, amount in self.terms]} if self.terms else {})}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProbeFigure:
        return cls(kind=str(data["kind"]), precision=str(data.get("precision", "")),
                   micro_batch=int(data.get("micro_batch", 0)), variant=str(data.get("variant", "")),
                   work=float(data["work"]), median_s=float(data["median_s"]), low_s=float(data["low_s"]),
                   high_s=float(data["high_s"]), repeats=int(data["repeats"]),
                   terms=tuple((str(name), float(amount)) for name, amount in data.get("terms", ())))


@dataclass(frozen=True, kw_only=True, slots=True)
class MachineProbe:
    """One probe of one machine for one study's shapes (module doc)."""

    machine: str
    """Which machine and software it was measured on (host, CPU, devices, library versions), in one line."""
    measured_at: str
    """When (ISO 8601, UTC)."""
    ranks: int
    """Ranks that ran it at once (the study's ranks per node)."""
    seconds: float
    """Wall time of the probe's measurements (its launch excluded)."""
    figures: tuple[ProbeFigure, ...]
    """What it measured."""
    skipped: tuple[tuple[str, str], ...] = ()
    """(what, why) for each operation the plan asked for and the machine could not time (no CUDA device,
    DeepSpeedCPUAdam not built, an NVMe folder not writable)."""

    def find(self, kind: str, *, precision: str = "", micro_batch: int = 0, variant: str = "") -> ProbeFigure | None:
        """The figure of that kind, precision, micro-batch and variant; None when the probe has none."""
        for figure in self.figures:
            if (figure.kind, figure.precision, figure.micro_batch, figure.variant) == (kind, precision, micro_batch,
                                                                                      variant):
                return figure
        return None

    def of_kind(self, kind: str) -> tuple[ProbeFigure, ...]:
        """Every figure of ``kind``."""
        return tuple(f for f in self.figures if f.kind == kind)

    def to_json(self) -> dict[str, Any]:
        return {"format": PROBE_FORMAT, "machine": self.machine, "measured_at": self.measured_at, "ranks": self.ranks,
                "seconds": self.seconds, "figures": [f.to_json() for f in self.figures],
                "skipped": [{"what": what, "why": why} for what, why in self.skipped]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MachineProbe:
        """The probe ``to_json`` wrote; ValueError for another format or a malformed entry."""
        if not isinstance(data, Mapping) or data.get("format") != PROBE_FORMAT:
            raise ValueError(f"not a probe of format {PROBE_FORMAT}")
        try:
            return cls(machine=str(data["machine"]), measured_at=str(data["measured_at"]), ranks=int(data["ranks"]),
                       seconds=float(data["seconds"]),
                       figures=tuple(ProbeFigure.from_json(f) for f in data["figures"]),
                       skipped=tuple((str(s["what"]), str(s["why"])) for s in data.get("skipped", ())))
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed probe: {err}") from err
