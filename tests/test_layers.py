"""Every module stays readable. (The import layers — study < deepspeed < ledger < perf < results < search <
launchers < cli — are import-linter's contracts in pyproject.toml, checked by ``lint-imports`` in ``dev.sh test``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _modules("optimizer") + _modules("launchers") + _modules("tests")
                         + _modules("benchmarks") + _modules("examples"), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_stays_readable(path):
    """Every file under ~400 lines: one screenful of concerns, not a page of them."""
    assert len(path.read_text(encoding="utf-8").splitlines()) <= 420
