"""The search space: the values each knob may take, read from ``search_spaces/*.yaml``.

A space file looks like::

    knobs:
      zero_stage: [0, 1, 2, 3]
      offload_optimizer: [none, cpu, nvme]
      precision: [fp32, bf16]
      checkpointing: [none, full, every_2, selective]
      micro_batch_size: [1, 2, 4, 8]

A knob the space does not list stays at the study's baseline value. The candidates are the
product of the lists; :mod:`optimizer.study.constraints` says which of them DeepSpeed can run.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from optimizer.study.errors import UserError
from optimizer.study.knobs import KNOB_NAMES, Candidate, parse_knob


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpace:
    """Knob name → the typed values it may take, in the order given."""

    values: tuple[tuple[str, tuple[object, ...]], ...]
    """(knob name, allowed values) pairs; knobs absent here keep the baseline value."""
    source: str
    """Where the space was read from (a file path, or ``STUDY.yaml#search_space``)."""

    def size(self) -> int:
        """Number of candidates in the product, valid or not."""
        total = 1
        for _, options in self.values:
            total *= len(options)
        return total

    def candidates(self, baseline: Candidate) -> Iterator[Candidate]:
        """Every combination of the listed values, the unlisted knobs at ``baseline``."""
        names = [name for name, _ in self.values]
        for combo in itertools.product(*(options for _, options in self.values)):
            yield replace(baseline, **dict(zip(names, combo, strict=True)))


def parse_search_space(raw: object, *, source: str, key_prefix: str = "") -> SearchSpace:
    """Build a :class:`SearchSpace` from the YAML mapping ``raw`` read from ``source``.

    Raises :class:`UserError` naming ``source`` and the offending key.
    """
    prefix = f"{key_prefix}." if key_prefix else ""
    if not isinstance(raw, Mapping):
        why = f"expected a mapping with 'knobs', got {type(raw).__name__}"
        raise UserError(source=source, key=key_prefix, why=why)
    unknown = sorted(set(raw) - {"knobs", "description"}, key=str)
    if unknown:
        raise UserError(source=source, key=f"{prefix}{unknown[0]}", why="unknown key; allowed: knobs, description")
    knobs = raw.get("knobs")
    if not isinstance(knobs, Mapping) or not knobs:
        why = "expected a non-empty mapping of knob -> list of values"
        raise UserError(source=source, key=f"{prefix}knobs", why=why)
    values: list[tuple[str, tuple[object, ...]]] = []
    for name, options in knobs.items():
        key = f"{prefix}knobs.{name}"
        if name not in KNOB_NAMES:
            raise UserError(source=source, key=key, why=f"unknown knob; knobs are {', '.join(KNOB_NAMES)}")
        if not isinstance(options, list) or not options:
            raise UserError(source=source, key=key, why="expected a non-empty list of values")
        parsed: list[object] = []
        for option in options:
            try:
                value = parse_knob(name, option)
            except ValueError as err:
                raise UserError(source=source, key=key, why=str(err)) from None
            if value in parsed:
                raise UserError(source=source, key=key, why=f"value {option!r} is listed twice")
            parsed.append(value)
        values.append((name, tuple(parsed)))
    return SearchSpace(values=tuple(values), source=source)
