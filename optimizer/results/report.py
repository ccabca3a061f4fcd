"""Render ledgers for people (tables like the seed's) and for programs (JSON). Pure formatting."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from optimizer.ledger.activations import activation_source
from optimizer.ledger.core import Ledger, Verdict
from optimizer.ledger.items import Category, LedgerItem, Location, Phase
from optimizer.perf.throughput import StepTime
from optimizer.study.units import GB, GiB, format_bytes


def _category_bytes(items: Sequence[LedgerItem], *, scale: int = 1) -> dict[str, int]:
    out = {category.value: 0 for category in Category}
    for item in items:
        out[item.category.value] += item.bytes * scale
    out["total"] = sum(out.values())
    return out


class Limit(StrEnum):
    """A capacity a candidate can exceed: the checks of :meth:`Ledger.verdict_reasons`, the device's split by phase."""

    GPU = "gpu"
    """Device memory at training's peak (a transient phase over the always-live items)."""
    INIT = "init"
    """Device memory at the init phase's peak (building the model, before DeepSpeed placed it)."""
    HOST = "host"
    """Host RAM per node (on CPU ranks with the device items: one memory)."""
    NVME = "nvme"
    """NVMe per node."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Shortfall:
    """One limit a ledger exceeds, with the figures :meth:`Ledger.verdict_reasons` prints."""

    limit: Limit
    """Which capacity."""
    phase: Phase
    """The phase of the peak at that place (``init`` for :attr:`Limit.INIT`)."""
    needed_bytes: int
    """What the candidate needs there: per GPU (needed = reserved peak + device reserve), or per node."""
    capacity_bytes: int
    """What the study gives there."""

    @property
    def over_bytes(self) -> int:
        """needed − capacity (> 0)."""
        return self.needed_bytes - self.capacity_bytes

    @property
    def over_fraction(self) -> float:
        """over / capacity: how far over, relative to the limit (inf for a zero capacity)."""
        return self.over_bytes / self.capacity_bytes if self.capacity_bytes else math.inf

    def json(self) -> dict[str, object]:
        """The shortfall for programs: integer bytes (``over`` = needed − capacity)."""
        return {"limit": self.limit.value, "phase": self.phase.value, "needed": self.needed_bytes,
                "capacity": self.capacity_bytes, "over": self.over_bytes}


def shortfalls(ledger: Ledger) -> tuple[Shortfall, ...]:
    """Every limit ``ledger`` exceeds (empty when it fits), binding first (the largest :attr:`~Shortfall.over_fraction`;
    ties in :meth:`Ledger.verdict_reasons`' order GPU, host, NVMe). One per reason, with its figures: the device
    needs ``gpu_needed_bytes`` of ``gpu_capacity_bytes`` — :data:`Limit.INIT` when that peak is the init phase's
    (the ledger has no separate init verdict: its device peak is the larger of init and training) —, the host
    ``host_bytes`` of ``host_capacity_bytes``, NVMe ``nvme_bytes`` of ``nvme_capacity_bytes``; an unchecked capacity
    (None) is never a shortfall."""
    found: list[Shortfall] = []
    if not ledger.fits_gpu:
        phase = ledger.peak_phase
        found.append(Shortfall(limit=Limit.INIT if phase is Phase.INIT else Limit.GPU, phase=phase,
                               needed_bytes=ledger.gpu_needed_bytes, capacity_bytes=ledger.gpu_capacity_bytes))
    if ledger.fits_host is False and ledger.host_capacity_bytes is not None:
        found.append(Shortfall(limit=Limit.HOST, phase=ledger.peak_phase_at(ledger.host_locations),
                               needed_bytes=ledger.host_bytes, capacity_bytes=ledger.host_capacity_bytes))
    if ledger.fits_nvme is False and ledger.nvme_capacity_bytes is not None:
        found.append(Shortfall(limit=Limit.NVME, phase=ledger.peak_phase_at(Location.NVME),
                               needed_bytes=ledger.nvme_bytes, capacity_bytes=ledger.nvme_capacity_bytes))
    return tuple(sorted(found, key=lambda s: -s.over_fraction))  # stable: ties keep the reasons' order


def ledger_json(ledger: Ledger) -> dict[str, object]:
    """The ledger as one JSON-ready object; every byte figure is an integer."""
    per_gpu = ledger.per_gpu()
    per_gpu.update(
        reserved=ledger.predicted_reserved_bytes,
        device_reserve=ledger.device_reserve_bytes,
        needed=ledger.gpu_needed_bytes,
        capacity=ledger.gpu_capacity_bytes,
    )
    per_host = _category_bytes(ledger.peak_items_at(ledger.host_locations), scale=ledger.ranks_per_node)
    per_host.update(per_rank=ledger.peak_bytes_at(ledger.host_locations), ranks=ledger.ranks_per_node,
                    includes_device=ledger.device_is_host, needed=ledger.host_bytes,
                    capacity=ledger.host_capacity_bytes)
    nvme = _category_bytes(ledger.peak_items_at(Location.NVME), scale=ledger.ranks_per_node)
    nvme.update(per_rank=ledger.peak_bytes_at(Location.NVME), ranks=ledger.ranks_per_node,
                capacity=ledger.nvme_capacity_bytes)
    return {
        "candidate": ledger.candidate.knobs(),
        "label": ledger.candidate.label(),
        "valid": True,
        "per_gpu": per_gpu,
        "per_host": per_host,
        "nvme": nvme,
        "peak_phase": ledger.peak_phase.value,
        "activation_source": activation_source(ledger.items),
        "phase_totals": ledger.phase_totals(),
        "fits": ledger.fits,
        "fits_gpu": ledger.fits_gpu,
        "fits_host": ledger.fits_host,
        "fits_nvme": ledger.fits_nvme,
        "reasons": list(ledger.verdict_reasons()),
        "shortfalls": [s.json() for s in shortfalls(ledger)],
        "items": [_item_json(i) for i in ledger.items],
        "risk_bytes": ledger.risk_bytes,
        "risks": [_item_json(i) for i in ledger.risks],
    }


def _item_json(item: LedgerItem) -> dict[str, object]:
    return {"name": item.name, "category": item.category.value, "location": item.location.value,
            "phase": item.phase.value, "bytes": item.bytes, "formula": item.formula, "source": item.source}


def _fit_word(value: bool | None) -> str:
    return {True: "fits", False: "DOES NOT FIT", None: "unchecked (no capacity given)"}[value]


_POWERS = {"GB": "10^9", "GiB": "2^30", "MB": "10^6", "MiB": "2^20"}


def table_unit(binary: bool, capacity: int) -> tuple[str, int]:
    """The unit of a ledger's table: GiB (2^30) for a study that wrote ``hardware.gpu_memory`` in binary units,
    GB (10^9) otherwise — the seed document's; MiB / MB for a device under one GiB / GB (CPU-rank studies)."""
    if binary:
        return ("GiB", GiB) if capacity >= GiB else ("MiB", 2**20)
    return ("GB", GB) if capacity >= GB else ("MB", 10**6)


def _rows(rows: Sequence[tuple[str, str, int]], *, indent: str = "  ", scale: int = GB) -> list[str]:
    """Aligned ``item  formula  GB`` rows (``scale``: bytes per printed unit)."""
    name_w = max([len(r[0]) for r in rows] + [4])
    formula_w = max([len(r[1]) for r in rows] + [7])
    return [f"{indent}{name:<{name_w}}  {formula:<{formula_w}}  {num / scale:9.3f}" for name, formula, num in rows]


def _other_phases(ledger: Ledger, location: Location | tuple[Location, ...], *,
                  unit: tuple[str, int] = ("GB", GB)) -> list[str]:
    """The transient phases of ``location`` that are not its peak, with their items."""
    peak = ledger.peak_phase_at(location)
    where = location if isinstance(location, tuple) else (location,)
    lines: list[str] = []
    for phase in Phase:
        items = [i for i in ledger.items if i.location in where and i.phase is phase]
        if phase is Phase.ALWAYS or phase is peak or not items:
            continue
        if not lines:
            lines.append("  Other phases (not at the peak), per rank:")
        if phase is Phase.INIT:
            lines.append(f"    {phase.value}: {sum(i.bytes for i in items) / unit[1]:.3f} {unit[0]} (nothing else "
                         "allocated yet)")
        else:
            always = sum(i.bytes for i in ledger.items if i.location in where and i.phase is Phase.ALWAYS)
            total = always + sum(i.bytes for i in items)
            if peak is Phase.INIT:  # the always-live items are not in the peak listing: show them here
                lines.append(f"    {phase.value}: {total / unit[1]:.3f} {unit[0]}")
                items = [i for i in ledger.items if i.location in where and i.phase is Phase.ALWAYS] + items
            else:
                lines.append(f"    {phase.value}: {total / unit[1]:.3f} {unit[0]} with the always-live items")
        lines += _rows([(i.name, i.formula, i.bytes) for i in items], indent="      ", scale=unit[1])
    return lines


def ledger_table(ledger: Ledger, *, study: str, psi: int, binary: bool = False) -> str:
    """A readable ledger like the seed's: item, formula, bytes in GB (10^9) — or in GiB (2^30) for a study that
    wrote its device memory in binary units (``binary``) — then the verdict."""
    unit = table_unit(binary, ledger.gpu_capacity_bytes)
    lines = [
        f"study {study} · candidate {ledger.candidate.label()}",
        f"Ψ = {psi:,} parameters · {ledger.ranks_per_node} rank(s) per node · figures in {unit[0]} "
        f"({unit[0]} = {_POWERS[unit[0]]} bytes)",
        "",
        f"Per GPU — peak in the {ledger.peak_phase.value} phase",
    ]
    peak = ledger.peak_items()
    summary = [("allocated peak", "sum", ledger.per_gpu()["total"])]
    if ledger.allocator_overhead:
        overhead = f"reserved peak (allocator +{ledger.allocator_overhead:.0%})"
        summary.append((overhead, "", ledger.predicted_reserved_bytes))
    if ledger.device_reserve_bytes:
        summary.append(("device reserve (CUDA context, NCCL)", "", ledger.device_reserve_bytes))
    summary.append(("needed", "", ledger.gpu_needed_bytes))
    table = _rows([(i.name, i.formula, i.bytes) for i in peak] + summary, scale=unit[1])
    lines += [*table[:len(peak)], "  " + "-" * (len(table[0]) - 2), *table[len(peak):]]
    lines.append(f"  activations from: {activation_source(ledger.items)}")
    if ledger.risks:
        lines.append(f"  live in some runs only — not in the need, priced as launch risk "
                     f"(+{format_bytes(ledger.risk_bytes, binary=binary)} at the peak):")
        lines += _rows([(f"{i.name} ({i.phase.value})", i.formula, i.bytes) for i in ledger.risks],
                       indent="    ", scale=unit[1])
    cap = ledger.gpu_capacity_bytes
    lines.append(f"  capacity {format_bytes(cap, binary=binary)}: {_fit_word(ledger.fits_gpu)}")
    other = _other_phases(ledger, Location.GPU, unit=unit)
    lines += ["", *other] if other else []
    for location, title, capacity, total, fits in (
        (Location.HOST, "Host RAM per node", ledger.host_capacity_bytes, ledger.host_bytes, ledger.fits_host),
        (Location.NVME, "NVMe per node", ledger.nvme_capacity_bytes, ledger.nvme_bytes, ledger.fits_nvme),
    ):
        if not any(i.location is location for i in ledger.items):
            continue
        where = ledger.host_locations if location is Location.HOST else location
        phase = ledger.peak_phase_at(where)
        lines += ["", f"{title} — {ledger.ranks_per_node} rank(s) × the per-rank peak ({phase.value} phase)"]
        if location is Location.HOST and ledger.device_is_host:
            lines.append("  (CPU ranks: device and host items share host RAM, so they peak together)")
        lines += _rows([(i.name, i.formula, i.bytes) for i in ledger.peak_items_at(where)], scale=unit[1])
        cap_text = "?" if capacity is None else format_bytes(capacity, binary=binary)
        lines.append(f"  needed {format_bytes(total, binary=binary)} of {cap_text}: {_fit_word(fits)}")
        lines += _other_phases(ledger, where, unit=unit)
    lines += ["", f"Verdict: {'FITS' if ledger.fits else 'DOES NOT FIT'}"
              + ("" if ledger.fits else f" — {'; '.join(ledger.verdict_reasons())}")]
    sources = sorted({i.source for i in ledger.items + ledger.risks})
    lines += ["", "Sources:"] + [f"  - {src}" for src in sources]
    return "\n".join(lines)


def _short_source(ledger: Ledger) -> str:
    source = activation_source(ledger.items)
    return "formula*" if "trace failed" in source or "no trace" in source else source


def _sort_key(verdict: Verdict) -> tuple[int, int, str]:
    if verdict.ledger is None:
        return (2, 0, verdict.candidate.label())
    return (0 if verdict.ledger.fits else 1, verdict.ledger.gpu_needed_bytes, verdict.candidate.label())


def counts(verdicts: Sequence[Verdict]) -> dict[str, int]:
    """How many candidates are valid, invalid, fit and do not fit."""
    valid = [v for v in verdicts if v.ledger is not None]
    fit = sum(1 for v in valid if v.ledger is not None and v.ledger.fits)
    return {"total": len(verdicts), "valid": len(valid), "invalid": len(verdicts) - len(valid),
            "fits": fit, "does_not_fit": len(valid) - fit}


def _verdict_word(ledger: Ledger) -> str:
    """``fits``, or ``no: `` and the limits exceeded, binding first (``no: host``, ``no: init+host``)."""
    falls = shortfalls(ledger)
    return "no: " + "+".join(f.limit.value for f in falls) if falls else "fits"


def all_table(verdicts: Sequence[Verdict], *, study: str, speeds: Mapping[str, StepTime | str] | None = None,
              binary: bool = False) -> str:
    """``--all``: every candidate, sorted (fitting by needed memory, then the rest, then invalid), with the
    throughput model's tokens/s by candidate label when ``speeds`` is given; a candidate that does not fit names
    the limits it exceeds (:func:`shortfalls`). Figures in GB or MB — GiB or MiB for a study that wrote its
    device memory in binary units (``binary``)."""
    speeds = speeds or {}
    ordered = sorted(verdicts, key=_sort_key)
    largest = max((v.ledger.gpu_needed_bytes for v in verdicts if v.ledger is not None), default=0)
    unit, scale = table_unit(binary, largest * 10)
    words = {id(v): _verdict_word(v.ledger) for v in verdicts if v.ledger is not None}
    w = max([13, *map(len, words.values())])
    lines = [f"study {study} · {len(verdicts)} candidates · {unit} = {_POWERS[unit]} bytes (per GPU: needed = "
             "reserved peak + device reserve)", "",
             f"  {'verdict':<{w}} {'GPU needed ' + unit:>13} {'host ' + unit:>9} {'nvme ' + unit:>9} "
             f"{'tokens/s':>10}  {'activations':<11}  candidate"]
    for v in ordered:
        if v.ledger is None:
            lines.append(f"  {'invalid':<{w}} {'-':>13} {'-':>9} {'-':>9} {'-':>10}  {'-':<11}  {v.candidate.label()}: "
                         + "; ".join(v.invalid_reasons))
            continue
        led = v.ledger
        speed = speeds.get(v.candidate.label())
        speed_text = f"{speed.tokens_per_s:>10,.0f}" if isinstance(speed, StepTime) else f"{'unknown':>10}"
        lines.append(f"  {words[id(v)]:<{w}} {led.gpu_needed_bytes / scale:>13.2f} {led.host_bytes / scale:>9.2f} "
                     f"{led.nvme_bytes / scale:>9.2f} {speed_text}  {_short_source(led):<11}  {v.candidate.label()}")
    c = counts(verdicts)
    sources = {step.source for step in speeds.values() if isinstance(step, StepTime)}
    if speeds:
        lines += ["", "tokens/s: the throughput model (" + (", ".join(sorted(sources)) or "no figures") + "); "
                  "'unknown' where a figure it needs is missing"]
    if any(word != "fits" for word in words.values()):
        lines += ["", "no: the limit it exceeds, the furthest over (relative) first — gpu: training's device peak, "
                  "init: the device while the model is built, host: RAM per node, nvme: per node"]
    if any("*" in _short_source(v.ledger) for v in ordered if v.ledger is not None):
        lines += ["", "formula*: the study asked for traced activations but the trace failed; `dsopt trace` says why"]
    lines += ["", f"{c['valid']} valid ({c['fits']} fit, {c['does_not_fit']} do not fit), {c['invalid']} invalid, "
              f"{c['total']} in all"]
    return "\n".join(lines)


def all_json(verdicts: Sequence[Verdict], *, study: str) -> dict[str, object]:
    """``--all --json``: the counts and one entry per candidate, sorted as the table is."""
    entries: list[dict[str, object]] = []
    for v in sorted(verdicts, key=_sort_key):
        if v.ledger is None:
            entries.append({"candidate": v.candidate.knobs(), "label": v.candidate.label(), "valid": False,
                            "fits": False, "reasons": list(v.invalid_reasons)})
        else:
            entries.append(ledger_json(v.ledger))
    return {"study": study, "counts": counts(verdicts), "candidates": entries}


def throughput_lines(step: StepTime | str) -> list[str]:
    """The throughput model's prediction for one candidate, itemised (or why it is unknown)."""
    if isinstance(step, str):
        return ["Throughput model:", f"  {step}"]
    lines = [f"Throughput model ({step.source}): {step.tokens_per_s:,.0f} tokens/s, {step.total_s:.4g} s per "
             "optimizer step"]
    lines += [f"  {name:<15} {seconds:10.4g} s" for name, seconds in step.terms_s if seconds > 0]
    return lines
