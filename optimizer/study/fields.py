"""Typed reads of one study-file mapping: each names the file and the dotted key on error, refuses unknown keys,
and accepts what people write (``1e-4``) but nothing PyYAML lets pass silently (pure)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from optimizer.study import limits
from optimizer.study.errors import UserError
from optimizer.study.units import parse_count, parse_size

T = TypeVar("T")


MISSING = object()


class Section:
    """One mapping of the study file: typed reads that name the key on error, and no unknown keys."""

    def __init__(self, raw: object, *, source: str, key: str) -> None:
        if not isinstance(raw, Mapping):
            raise UserError(source=source, key=key, why=f"expected a mapping, got {type(raw).__name__}")
        self.raw: Mapping[str, Any] = raw
        self.source = source
        self.key = key
        self.seen: set[str] = set()

    def full_key(self, name: str) -> str:
        return f"{self.key}.{name}" if self.key else name

    def error(self, name: str, why: str) -> UserError:
        return UserError(source=self.source, key=self.full_key(name), why=why)

    def get(self, name: str, parse: Callable[[Any], T], default: Any = MISSING) -> T:
        self.seen.add(name)
        if name not in self.raw or self.raw[name] is None:
            if default is MISSING:
                raise self.error(name, "required key is missing")
            return default
        try:
            return parse(self.raw[name])
        except (ValueError, TypeError) as err:
            raise self.error(name, str(err)) from None

    def finish(self) -> None:
        unknown = sorted(set(self.raw) - self.seen, key=str)
        if unknown:
            allowed = ", ".join(sorted(self.seen))
            raise self.error(str(unknown[0]), f"unknown key; allowed here: {allowed}")


def built(section: Section, make: Callable[[], T]) -> T:
    """``make()`` a spec from the section's reads; its own ValueError names the key; then no unknown keys."""
    try:
        value = make()
    except ValueError as err:
        raise spec_error(section, err) from None
    section.finish()
    return value


def spec_error(section: Section, err: ValueError) -> UserError:
    """A spec's own validation error, keyed by the field its message starts with (else the section)."""
    first = str(err).split(" ", 1)[0]
    key = section.full_key(first) if first in section.raw else section.key
    return UserError(source=section.source, key=key, why=str(err))


def as_positive_int(value: Any) -> int:
    count = parse_count(value)
    if count < 1:
        raise ValueError(f"expected a positive whole number, got {value!r}")
    return count


def count_within(limit: int, what: str) -> Callable[[Any], int]:
    """A positive whole number no greater than ``limit`` (:mod:`optimizer.study.limits`)."""
    def parse(value: Any) -> int:
        count = as_positive_int(value)
        if why := limits.beyond(count, limit, what):
            raise ValueError(why)
        return count

    return parse


def bytes_within(limit: int, what: str) -> Callable[[Any], int]:
    """A byte size with its unit (a bare number is refused with the fix: :func:`~optimizer.study.units.parse_size`)
    no greater than ``limit`` (:mod:`optimizer.study.limits`)."""
    def parse(value: Any) -> int:
        size = parse_size(value)
        if why := limits.beyond(size, limit, what, unit="bytes"):
            raise ValueError(why)
        return size

    return parse


def as_text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected text, got {type(value).__name__}")
    return value


def as_path(value: Any) -> str:
    """A filesystem path: non-empty text on one line (``""`` would silently mean the current folder)."""
    text = as_text(value)
    if not text.strip() or not text.isprintable():
        raise ValueError(f"expected a path (non-empty text on one line), got {value!r}")
    return text


def as_study_name(value: Any) -> str:
    text = as_text(value)
    if not text or not all(ch.isalnum() or ch in "-_." for ch in text) or text.startswith("."):
        raise ValueError(f"a study name may hold letters, digits, '-', '_' and '.', got {value!r}")
    return text


def as_entry_point(value: Any) -> str:
    text = as_text(value)
    module, sep, function = text.partition(":")
    if not sep or not module or not function:
        raise ValueError(f"expected 'module:function', got {value!r}")
    return text


def as_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


YAML12_FLOAT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
"""A decimal number as YAML 1.2 writes it. PyYAML follows YAML 1.1, whose floats need a dot and a signed
exponent, so ``1e-4`` and ``3e-3`` arrive as strings; people write them, and they mean the number."""


def as_fraction(value: Any) -> float:
    """A finite real number: an int, a float, or a string that is a YAML 1.2 decimal (``1e-4``)."""
    if isinstance(value, str) and YAML12_FLOAT.fullmatch(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def as_enum(kind: type[T]) -> Callable[[Any], T]:
    def parse(value: Any) -> T:
        try:
            return kind(str(value).lower())  # type: ignore[call-arg]
        except ValueError:
            allowed = ", ".join(member.value for member in kind)  # type: ignore[attr-defined]
            raise ValueError(f"expected one of {allowed}, got {value!r}") from None

    return parse


def as_enum_str(allowed: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {value!r}")
        return str(value)

    return parse


def as_text_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError("expected a list of text items")
    return tuple(value)


def as_count_text(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"expected text or a whole number, got {value!r}")
    return str(value)


POSITIONS = count_within(limits.MAX_TOKENS, "context length")
HOST_BYTES = bytes_within(limits.MAX_HOST_BYTES, "host memory")
DEVICE_BYTES = bytes_within(limits.MAX_DEVICE_BYTES, "device memory")
