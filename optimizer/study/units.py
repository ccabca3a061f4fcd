"""Byte quantities: parsing from study files and printing for people.

Bytes are integers everywhere in dsopt. In the UI, ``GB`` is 10^9 bytes and ``GiB`` is
2^30 bytes; every printed figure says which (docs/layout.md, "Conventions").

A study file's memory keys are read with :func:`parse_size`, which refuses a bare number: ``gpu_memory: 80``
would otherwise be 80 bytes, and the error would surface far away (issue 23). :func:`parse_bytes` stays for
code that really holds an int of bytes.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

GB = 10**9
GiB = 2**30

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


MAX_BYTES = 2**63 - 1
"""The largest byte quantity accepted (an int64, as PyTorch and DeepSpeed count bytes); beyond it figures
overflow when printed as floats, and no machine has it."""


def parse_bytes(value: object) -> int:
    """Parse ``value`` into a whole number of bytes.

    Accepts an int or float (bytes), or a string such as ``"24 GB"``, ``"80GiB"``,
    ``"8e9"`` (YAML 1.1 reads ``8e9`` as a string). Raises ``ValueError`` with the reason.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a byte quantity, got {value!r}")
    if isinstance(value, int):
        number: float | Fraction = value
        scale = 1
    elif isinstance(value, float):
        number, scale = value, 1
    elif isinstance(value, str):
        match = _QUANTITY.match(value)
        if match is None:
            raise ValueError(f"expected a byte quantity such as '24 GB' or '80 GiB', got {value!r}")
        number = Fraction(match.group(1))  # exact: "4.1 GB" is 4_100_000_000 bytes, not 4.1 * 1e9 in floats
        unit = match.group(2).lower() or "b"
        if unit not in _UNITS:
            raise ValueError(
                f"unknown unit {match.group(2)!r} in {value!r}; use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            )
        scale = _UNITS[unit]
    else:
        raise ValueError(f"expected a byte quantity, got {type(value).__name__} {value!r}")
    total = number * scale
    if (isinstance(total, float) and not math.isfinite(total)) or total < 0:
        raise ValueError(f"expected a non-negative byte quantity, got {value!r}")
    if total > MAX_BYTES:
        raise ValueError(f"{value!r} is more than {MAX_BYTES:,} bytes (2^63 - 1, about 9.2 EB)")
    if total != int(total):
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(total)


_BINARY_UNITS = frozenset({"kib", "mib", "gib", "tib"})
_DECIMAL_UNITS = frozenset({"kb", "mb", "gb", "tb"})


def _no_unit(value: object) -> str:
    """The error for a number without a unit: which key is the caller's to add; the fix is ours to give."""
    text = str(value).strip()
    hint = f'write "{text} GiB" (2^30 bytes) or "{text} GB" (10^9 bytes)'
    return f"{text} has no unit; {hint}" + (f', or "{text} B" for bytes' if _as_number(text) >= 2**20 else "")


def _as_number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def parse_size(value: object) -> int:
    """A study file's byte quantity: like :func:`parse_bytes` but the unit is required (``"80 GiB"``,
    ``"24 GB"``, ``"512 B"``). A bare number (an int, a float, or a string without unit) raises ValueError with
    the fix; exactly 0 is allowed without unit (zero in any unit)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte quantity such as '24 GB' or '80 GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value == 0:
            return 0
        raise ValueError(_no_unit(value))
    if isinstance(value, str):
        match = _QUANTITY.match(value)
        if match is not None and not match.group(2) and Fraction(match.group(1)) != 0:
            raise ValueError(_no_unit(value))
    return parse_bytes(value)


def size_family(value: object) -> bool | None:
    """The unit family a study wrote ``value`` in: True for binary (KiB, MiB, GiB, TiB), False for decimal
    (kB, MB, GB, TB), None for bytes, a bare 0 or anything else."""
    match = _QUANTITY.match(value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match is not None else ""
    return True if unit in _BINARY_UNITS else False if unit in _DECIMAL_UNITS else None


def parse_rate(value: object) -> float:
    """A bandwidth in bytes per second, unit required: ``"50 GB/s"``, ``"2.0 TB/s"``, ``"900 GiB/s"``; > 0."""
    text = value.strip() if isinstance(value, str) else ""
    match = _QUANTITY.match(text.removesuffix("/s")) if text.endswith("/s") else None
    if match is None or not match.group(2):
        raise ValueError(f"expected a bandwidth with its unit such as '50 GB/s' or '2 TB/s', got {value!r}")
    rate = float(parse_bytes(text.removesuffix("/s").strip()))
    if rate <= 0:
        raise ValueError(f"expected a bandwidth above 0, got {value!r}")
    return rate


_FLOP_PREFIXES: dict[str, float] = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_FLOP_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtTpP]?)FLOP/s\s*$")


def parse_flop_rate(value: object) -> float:
    """Floating-point operations per second, unit required: ``"312 TFLOP/s"``, ``"19.5 TFLOP/s"``,
    ``"1.2 PFLOP/s"`` (decimal prefixes, as datasheets print them); > 0."""
    match = _FLOP_RATE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"expected a FLOP rate with its unit such as '312 TFLOP/s', got {value!r}")
    rate = float(match.group(1)) * _FLOP_PREFIXES[match.group(2).lower()]
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"expected a FLOP rate above 0, got {value!r}")
    return rate


def parse_count(value: object) -> int:
    """Parse a whole, non-negative count given as an int, an integral float or a string like ``"1e9"``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a whole number, got {value!r}")
    if isinstance(value, int):
        number: float = value
    elif isinstance(value, float):
        number = value
    elif isinstance(value, str):
        try:
            number = float(value.replace("_", ""))
        except ValueError:
            raise ValueError(f"expected a whole number such as 1e9, got {value!r}") from None
    else:
        raise ValueError(f"expected a whole number, got {type(value).__name__} {value!r}")
    if not math.isfinite(number) or number < 0 or number != int(number):
        raise ValueError(f"expected a whole, non-negative number, got {value!r}")
    return int(number)


def format_size(num_bytes: int) -> str:
    """Decimal units sized to the figure: ``'26.00 GB'``, ``'3.38 MB'``, ``'512.00 kB'`` (10^9, 10^6, 10^3)."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(num_bytes) >= scale / 10:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


_BINARY_STEPS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_DECIMAL_STEPS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def _in_family(num_bytes: int, steps: tuple[tuple[str, int], ...]) -> tuple[str, str]:
    """(number, unit) of ``num_bytes`` in the largest unit of ``steps`` it reaches; whole bytes below them."""
    for unit, scale in steps:
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f}", unit
    return str(num_bytes), "B"


def format_bytes(num_bytes: int, *, binary: bool, other: bool = True) -> str:
    """``num_bytes`` in the study's unit family, sized to the figure, with the other family in brackets where the
    two printed figures differ: ``format_bytes(80 * 2**30, binary=True) == '80.00 GiB (85.90 GB)'``,
    ``format_bytes(3 * 10**6, binary=False) == '3.00 MB (2.86 MiB)'``, ``format_bytes(0, binary=True) == '0 B'``.

    The family is the one the study wrote ``hardware.gpu_memory`` in (:attr:`HardwareSpec.binary_units`), so a
    figure reads as the user's own budget does; the bracket says the same bytes the other way (GB = 10^9 bytes,
    GiB = 2^30). ``other=False`` leaves the bracket out (a table whose header names both units)."""
    mine = _in_family(num_bytes, _BINARY_STEPS if binary else _DECIMAL_STEPS)
    text = f"{mine[0]} {mine[1]}"
    if not other:
        return text
    theirs = _in_family(num_bytes, _DECIMAL_STEPS if binary else _BINARY_STEPS)
    return text if theirs[0] == mine[0] else f"{text} ({theirs[0]} {theirs[1]})"
