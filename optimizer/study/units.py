"""Byte quantities: parsing from study files and printing for people.

Bytes are integers everywhere in dsopt. In the UI, ``GB`` is 10^9 bytes and ``GiB`` is
2^30 bytes; every printed figure says which (docs/layout.md, "Conventions").
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
