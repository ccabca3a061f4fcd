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


def test_no_two_files_import_each_other():
    """No file circle in optimizer/ or launchers/ (``benchmarks/import_graph.py``, which draws the rooms, finds
    them: strongly connected sets of modules, a package's ``__init__`` importing its own modules aside)."""
    import importlib.util

    import grimp

    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "benchmarks" / "import_graph.py")
    drawing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drawing)
    graph = grimp.build_graph("optimizer", "launchers")
    loops = [c for c in drawing.circles(graph) if not any(m + "." in n for m in c for n in c)]
    assert loops == []
