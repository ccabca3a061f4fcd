"""The import layers: the CLI (``optimizer/cli/``) on top, the launchers (processes, devices) under it, the pure
library (the rest of ``optimizer/``) at the bottom. Imports only point down: read from every module's source,
every ``import`` statement counted — those inside functions and under ``TYPE_CHECKING`` too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) for every import in ``source``: ``import a.b`` gives ``a.b``; ``from a import b`` gives
    ``a.b`` (b may be a module or a name: both are checked against the layer's prefixes); relative imports
    are refused, the project has none."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"line {node.lineno}: relative import"
            assert node.module is not None
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def violations(source: str, *, forbidden: tuple[str, ...]) -> list[str]:
    """The imports of ``source`` that name a forbidden package or anything in it."""
    return [f"line {line}: {name}" for line, name in imported_modules(source)
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


PURE = [p for p in _modules("optimizer") if "cli" not in p.relative_to(ROOT / "optimizer").parts]
LAUNCHERS = _modules("launchers")


def test_the_checker_sees_every_kind_of_import():
    source = ("import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from launchers.node_share import X\n"
              "def f():\n    import launchers.trial as t\n    from optimizer import cli\n")
    assert violations(source, forbidden=("launchers", "optimizer.cli")) == [
        "line 4: launchers.node_share", "line 4: launchers.node_share.X", "line 6: launchers.trial",
        "line 7: optimizer.cli"]
    assert violations("import launchersque\nfrom optimizer.client import x\n",
                      forbidden=("launchers", "optimizer.cli")) == []


def test_the_layers_hold_every_module():
    assert len(PURE) > 30 and len(LAUNCHERS) > 15  # the walk found the tree
    assert {p.parent.name for p in PURE} >= {"study", "ledger", "deepspeed", "perf", "search", "results"}


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_pure_library_never_imports_launchers_or_the_cli(path):
    assert violations(path.read_text(encoding="utf-8"), forbidden=("launchers", "optimizer.cli")) == []


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_launchers_never_import_the_cli(path):
    assert violations(path.read_text(encoding="utf-8"), forbidden=("optimizer.cli",)) == []


@pytest.mark.parametrize("path", _modules("optimizer") + LAUNCHERS + _modules("tests") + _modules("benchmarks"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_stays_readable(path):
    """Every file under ~400 lines: one screenful of concerns, not a page of them."""
    assert len(path.read_text(encoding="utf-8").splitlines()) <= 420
