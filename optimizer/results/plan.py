"""The plan ``dsopt ledger STUDY`` prints: what fits, fastest first; what misses, by how little and which limit;
what is invalid, counted by reason (pure: no torch, no deepspeed, no I/O).

From the verdicts of a search space and the throughput model's speeds (candidate label → :class:`StepTime`, or the
reason the speed is unknown):

1. the candidates that fit, by predicted tokens/s (highest first; unknown speeds after the known ones, then by
   needed device memory, least first), each with its device need and headroom (capacity − needed, and as a share
   of the capacity) and, where used, its host RAM and NVMe per node; the fastest named in the first lines; the
   top ``top`` rows shown and the rest counted (``--all`` lists them);
2. the ``closest`` candidates that do not fit, by how far over their binding limit they are relative to that
   limit, each with every limit it exceeds and by how much (:func:`~optimizer.results.report.shortfalls`);
3. the invalid candidates counted by reason (a candidate with several reasons is counted under each), listed
   with ``show_invalid``;
4. one line of counts.

*Twins*: a bf16 and an fp16 candidate that differ in nothing else, with the same needs and the same speed, are
one row with the precision ``bf16|fp16``. :func:`plan_json` gives the same for programs, a candidate per entry.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from optimizer.ledger.core import Ledger, Verdict
from optimizer.ledger.items import Location, Phase
from optimizer.perf.throughput import StepTime
from optimizer.results.report import Limit, Shortfall, counts, shortfalls
from optimizer.study.knobs import Precision
from optimizer.study.units import format_size

__all__ = ["Limit", "Shortfall", "plan_json", "plan_text", "shortfalls"]

Speeds = Mapping[str, StepTime | str]
"""Candidate label → the throughput model's prediction, or the reason it has none."""

TWIN_PRECISION = "bf16|fp16"
"""How a row of twins spells its precision."""

_LIMIT_TEXT = {Limit.GPU: "GPU", Limit.INIT: "GPU at init (building the model)",
               Limit.HOST: "host RAM per node", Limit.NVME: "NVMe per node"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Row:
    """One row of the plan: a candidate, or a bf16/fp16 pair of twins (``twin`` set)."""

    verdict: Verdict
    """The candidate (the bf16 one of twins)."""
    twin: Verdict | None
    """The fp16 twin, if collapsed into this row."""
    speed: StepTime | str | None
    """Its predicted speed, or why it is unknown (None: not predicted)."""
    needs: tuple[int, int, int]
    """Bytes needed per GPU, host RAM and NVMe per node (computed once: the ledger's properties sum its items)."""
    falls: tuple[Shortfall, ...]
    """Its shortfalls, binding first (empty: it fits)."""

    @property
    def ledger(self) -> Ledger:
        assert self.verdict.ledger is not None
        return self.verdict.ledger

    @property
    def label(self) -> str:
        label = self.verdict.candidate.label()
        if self.twin is None:
            return label
        parts = label.split(" ")  # label(): z<stage> <precision> ckpt=… mbs=… [opt->…] [param->…]
        return " ".join([parts[0], TWIN_PRECISION, *parts[2:]])

    @property
    def tokens_per_s(self) -> float | None:
        return self.speed.tokens_per_s if isinstance(self.speed, StepTime) else None


def _needs(ledger: Ledger) -> tuple[int, int, int]:
    return ledger.gpu_needed_bytes, ledger.host_bytes, ledger.nvme_bytes


def _same_speed(a: StepTime | str | None, b: StepTime | str | None) -> bool:
    if isinstance(a, StepTime) and isinstance(b, StepTime):
        return a.tokens_per_s == b.tokens_per_s
    return not isinstance(a, StepTime) and not isinstance(b, StepTime) and a == b


def _rows(verdicts: Sequence[Verdict], speeds: Speeds) -> list[_Row]:
    """The valid verdicts as rows, bf16/fp16 twins (same other knobs, needs and speed) collapsed."""
    figures = {id(v): (_needs(v.ledger), shortfalls(v.ledger)) for v in verdicts if v.ledger is not None}
    valid = [v for v in verdicts if v.ledger is not None]
    fp16 = {dataclasses.replace(v.candidate, precision=Precision.BF16): v
            for v in valid if v.candidate.precision is Precision.FP16}
    paired: set[int] = set()
    rows: list[_Row] = []
    for v in valid:
        speed = speeds.get(v.candidate.label())
        twin = fp16.get(v.candidate) if v.candidate.precision is Precision.BF16 else None
        if twin is not None and figures[id(twin)] == figures[id(v)] \
                and _same_speed(speed, speeds.get(twin.candidate.label())):
            paired.add(id(twin))
        else:
            twin = None
        needs, falls = figures[id(v)]
        rows.append(_Row(verdict=v, twin=twin, speed=speed, needs=needs, falls=falls))
    return [r for r in rows if id(r.verdict) not in paired]


def _fast_first(row: _Row) -> tuple[int, float, int, str]:
    tokens = row.tokens_per_s
    return (0 if tokens is not None else 1, -(tokens or 0.0), row.needs[0], row.label)


def _least_over(row: _Row) -> tuple[float, int, str]:
    binding = row.falls[0]
    return (binding.over_fraction, binding.over_bytes, row.label)


def _split(verdicts: Sequence[Verdict], speeds: Speeds) -> tuple[list[_Row], list[_Row]]:
    """(fitting rows fastest first, non-fitting rows least over first)."""
    rows = _rows(verdicts, speeds)
    fitting = sorted((r for r in rows if not r.falls), key=_fast_first)
    missing = sorted((r for r in rows if r.falls), key=_least_over)
    return fitting, missing


def invalid_by_reason(verdicts: Sequence[Verdict]) -> list[tuple[str, int]]:
    """(reason, candidates) for every distinct invalid reason, most frequent first; a candidate with several
    reasons counts under each."""
    tally = Counter(reason for v in verdicts if v.ledger is None for reason in v.invalid_reasons)
    return sorted(tally.items(), key=lambda item: (-item[1], item[0]))


def speed_source(speeds: Speeds) -> str:
    """Where the known speeds come from, in one line (the :attr:`StepTime.source` of each, once)."""
    sources = sorted({s.source for s in speeds.values() if isinstance(s, StepTime)})
    if not sources:
        return "tokens/s: no prediction"
    return f"tokens/s: the throughput model ({', '.join(sources)})"


def _headroom(row: _Row) -> tuple[int, float]:
    """(capacity − needed on the device, that as a share of the capacity)."""
    capacity = row.ledger.gpu_capacity_bytes
    left = capacity - row.needs[0]
    return left, left / capacity if capacity else 0.0


def _side_needs(ledger: Ledger, fmt: Callable[[int], str]) -> str:
    """Host RAM and NVMe per node where the candidate uses them: ``host 12.00 GB`` (the capacities are in the
    table's header: :func:`_side_header`)."""
    parts: list[str] = []
    if ledger.device_is_host or any(i.location is Location.HOST for i in ledger.items):
        parts.append(f"host {fmt(ledger.host_bytes)}")
    if ledger.nvme_bytes:
        parts.append(f"nvme {fmt(ledger.nvme_bytes)}")
    return ", ".join(parts)


def _side_header(rows: Sequence[_Row], fmt: Callable[[int], str]) -> str:
    """The host/NVMe column's title with the capacities per node (``?``: not stated, unchecked)."""
    if not rows:
        return "host / NVMe per node"
    ledger = rows[0].ledger
    host = "?" if ledger.host_capacity_bytes is None else fmt(ledger.host_capacity_bytes)
    nvme = "?" if ledger.nvme_capacity_bytes is None else fmt(ledger.nvme_capacity_bytes)
    return f"per node (host of {host}" + (f", nvme of {nvme})" if any(r.ledger.nvme_bytes for r in rows) else ")")


def shortfall_text(shortfall: Shortfall, fmt: Callable[[int], str] = format_size) -> str:
    """``host RAM per node: needs 301.20 GB of 256.00 GB (+45.20 GB, +17.7%)``."""
    where = _LIMIT_TEXT[shortfall.limit]
    if shortfall.limit is not Limit.INIT and shortfall.phase is Phase.INIT:
        where += " (init phase)"
    return (f"{where}: needs {fmt(shortfall.needed_bytes)} of {fmt(shortfall.capacity_bytes)} "
            f"(+{fmt(shortfall.over_bytes)}, +{shortfall.over_fraction:.1%})")


def _speed_text(row: _Row) -> str:
    tokens = row.tokens_per_s
    return "unknown" if tokens is None else f"{tokens:,.0f}"


def _table(header: Sequence[str], body: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Columns aligned to their widest cell (``right``: right-aligned columns), two spaces apart."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *body, strict=True)]
    return ["  " + "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                             for i, (cell, w) in enumerate(zip(cells, widths, strict=True))).rstrip()
            for cells in (header, *body)]


def _headline(fitting: list[_Row], missing: list[_Row], fmt: Callable[[int], str]) -> str:
    """The first line that matters: the fastest that fits, or what comes closest."""
    if fitting:
        best = fitting[0]
        left, share = _headroom(best)
        need = (f"\n  needs {fmt(best.needs[0])} per GPU of {fmt(best.ledger.gpu_capacity_bytes)}; "
                f"{fmt(left)} left ({share:.1%})")
        if best.tokens_per_s is None:
            return f"fits, speed unknown (least memory first): {best.label}{need}"
        return f"fastest that fits: {best.label} — {best.tokens_per_s:,.0f} tokens/s{need}"
    if missing:
        binding = missing[0].falls[0]
        return f"nothing fits; the closest: {missing[0].label} — {shortfall_text(binding, fmt)}"
    return "nothing fits: no candidate is valid"


def _speed_lines(rows: Sequence[_Row], speeds: Speeds, note: str | None) -> list[str]:
    """Where the speeds come from (once), and why the unknown ones are unknown (the two commonest reasons)."""
    reasons: Counter[str] = Counter()
    for row in rows:
        if isinstance(row.speed, str):
            reasons[row.speed.removeprefix("unknown: ")] += 2 if row.twin is not None else 1
    unknown = [f"tokens/s unknown for {n:,}: {reason}" for reason, n in reasons.most_common(2)]
    if note or any(isinstance(s, StepTime) for s in speeds.values()) or not unknown:
        return [note or speed_source(speeds), *unknown]
    return unknown


def plan_text(
    verdicts: Sequence[Verdict],
    speeds: Speeds,
    *,
    study: str,
    top: int = 15,
    closest: int = 5,
    show_invalid: bool = False,
    max_reasons: int = 8,
    speed_note: str | None = None,
    fmt: Callable[[int], str] = format_size,
    column_fmt: Callable[[int], str] | None = None,
) -> str:
    """The plan of a search space for a person (module doc): at most about 50 lines for ``top=15``, ``closest=5``
    and ``max_reasons=8`` invalid reasons, whatever the size of the space; ``show_invalid`` shows every reason and
    lists every invalid candidate under them. ``speed_note`` says where the speeds come from (default:
    :func:`speed_source`); ``fmt`` prints a byte figure (the CLI: the study's unit, the other in brackets),
    ``column_fmt`` one in the table of fitting candidates (default ``fmt``; the CLI: the study's unit alone, so
    a row fits a terminal's width)."""
    cell = column_fmt or fmt
    fitting, missing = _split(verdicts, speeds)
    c = counts(verdicts)
    lines = [f"study {study} · the plan: what fits, fastest first · GB = 10^9 bytes, GiB = 2^30 bytes",
             _headline(fitting, missing, fmt), *_speed_lines(fitting, speeds, speed_note)]
    if fitting:
        shown = fitting[:top]
        twins = sum(1 for r in fitting if r.twin is not None)
        rows_note = f" ({len(fitting):,} rows: {TWIN_PRECISION} twins as one)" if twins else ""
        lines += ["", f"{c['fits']:,} fit{rows_note}, fastest first" + (f" (the top {len(shown)})" if
                                                                          len(shown) < len(fitting) else "") + ":"]
        body = []
        for rank, row in enumerate(shown, start=1):
            left, share = _headroom(row)
            body.append([f"{rank}.", row.label, _speed_text(row), cell(row.needs[0]),
                         f"{cell(left)} {share:>6.1%}", _side_needs(row.ledger, cell)])
        lines += _table(["", "candidate", "tokens/s", "GPU needed", "GPU headroom", _side_header(shown, cell)], body,
                        right={0, 2, 3, 4})
        if len(fitting) > len(shown):
            lines.append(f"  … {len(fitting) - len(shown):,} more rows that fit: --all lists every candidate")
    if missing:
        shown = missing[:closest]
        some = f" — the {len(shown)} closest" if len(shown) < len(missing) else ""
        lines += ["", f"{c['does_not_fit']:,} do not fit{some}, least over their binding limit (relative) first:"]
        width = max(len(r.label) for r in shown)
        lines += [f"  {r.label:<{width}}  " + "; ".join(shortfall_text(s, fmt) for s in r.falls)
                  for r in shown]
    reasons = invalid_by_reason(verdicts)
    if reasons:
        lines += ["", f"{c['invalid']:,} invalid, by reason (a candidate with several reasons counts under each):"]
        width = len(f"{reasons[0][1]:,}")
        shown_reasons = reasons if show_invalid else reasons[:max_reasons]
        lines += [f"  {n:>{width},}  {reason}" for reason, n in shown_reasons]
        if len(shown_reasons) < len(reasons):
            lines.append(f"  … {len(reasons) - len(shown_reasons):,} other reasons")
        if show_invalid:
            lines += ["", "Invalid candidates:"] + [f"  {v.candidate.label()}: {'; '.join(v.invalid_reasons)}"
                                                    for v in verdicts if v.ledger is None]
        else:
            lines.append("  (--invalid lists them)")
    if any(r.twin is not None for r in fitting[:top] + missing[:closest]):
        lines += ["", f"{TWIN_PRECISION}: twins — the candidate in bf16 and in fp16, the same memory and speed"]
    lines += ["", f"{c['total']:,} candidates: {c['fits']:,} fit, {c['does_not_fit']:,} do not fit, "
              f"{c['invalid']:,} invalid"]
    return "\n".join(lines)


def _entry(row: _Row, verdict: Verdict, twin: Verdict | None, speed: StepTime | str | None) -> dict[str, object]:
    """One valid candidate of ``row`` for :func:`plan_json` (twins share the row's figures)."""
    ledger = row.ledger
    left, share = _headroom(row)
    gpu, host, nvme = row.needs
    return {
        "label": verdict.candidate.label(),
        "candidate": verdict.candidate.knobs(),
        "twin": None if twin is None else twin.candidate.label(),
        "needed": {"gpu": gpu, "host": host, "nvme": nvme},
        "capacity": {"gpu": ledger.gpu_capacity_bytes, "host": ledger.host_capacity_bytes,
                     "nvme": ledger.nvme_capacity_bytes},
        "headroom": {"gpu": left, "gpu_fraction": share},
        "tokens_per_s": speed.tokens_per_s if isinstance(speed, StepTime) else None,
        "speed_unknown": None if isinstance(speed, StepTime) else speed or "not predicted",
        "shortfalls": [s.json() for s in row.falls],
    }


def _entries(rows: Sequence[_Row], speeds: Speeds) -> list[dict[str, object]]:
    """Each row's candidates (twins as two entries, each naming the other)."""
    out: list[dict[str, object]] = []
    for row in rows:
        out.append(_entry(row, row.verdict, row.twin, row.speed))
        if row.twin is not None:
            out.append(_entry(row, row.twin, row.verdict, speeds.get(row.twin.candidate.label())))
    return out


def plan_json(verdicts: Sequence[Verdict], speeds: Speeds, *, closest: int = 5,
              speed_note: str | None = None) -> dict[str, object]:
    """The plan for programs: every fitting candidate in the plan's order (fastest first; twins adjacent, each
    naming the other in ``twin``), the candidates of the ``closest`` rows that do not fit with their
    ``shortfalls`` (binding first), the invalid reasons with their counts, and the counts. Bytes are integers."""
    fitting, missing = _split(verdicts, speeds)
    first = fitting[0] if fitting and fitting[0].tokens_per_s is not None else None
    return {
        "counts": counts(verdicts),
        "speed_source": speed_note or speed_source(speeds),
        "fastest": None if first is None else first.verdict.candidate.label(),
        "fitting": _entries(fitting, speeds),
        "closest_not_fitting": _entries(missing[:closest], speeds),
        "invalid": [{"reason": reason, "candidates": n} for reason, n in invalid_by_reason(verdicts)],
    }

