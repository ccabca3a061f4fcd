"""The package-level import graph of dsopt, drawn from the code (grimp, the graph import-linter checks).

    python benchmarks/import_graph.py            # a Mermaid drawing + every arrow that runs back up (none: exit 0)

Each arrow is "package A imports package B", with how many module-to-module imports make it; the layers are
import-linter's own order from pyproject.toml, top first. An arrow from a lower layer to a higher one runs back
up: it is listed and the script exits 1 (``lint-imports`` fails on the same imports). Prints only.
"""

from __future__ import annotations

import sys
import tomllib
from collections import Counter
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def layers() -> list[str]:
    """The layers contract's order from pyproject.toml, top first."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    return list(contract["layers"])


def package_of(module: str, order: list[str]) -> str | None:
    """The layer a module belongs to (the longest matching prefix), None outside every layer."""
    matches = [layer for layer in order if module == layer or module.startswith(layer + ".")]
    return max(matches, key=len) if matches else None


def main() -> int:
    order = layers()
    graph = grimp.build_graph("optimizer", "launchers")
    arrows: Counter[tuple[str, str]] = Counter()
    for module in graph.modules:
        source = package_of(module, order)
        for imported in graph.find_modules_directly_imported_by(module):
            target = package_of(imported, order)
            if source and target and source != target:
                arrows[(source, target)] += 1
    rank = {layer: index for index, layer in enumerate(order)}  # 0 = top
    print("```mermaid\nflowchart TD")
    for source, target in sorted(arrows, key=lambda a: (rank[a[0]], rank[a[1]])):
        print(f"  {source.replace('.', '_')}[{source}] -->|{arrows[(source, target)]}| "
              f"{target.replace('.', '_')}[{target}]")
    print("```")
    upward = [(s, t) for (s, t) in arrows if rank[t] < rank[s]]
    print(f"{len(arrows)} arrows between {len(order)} layers; running back up: {len(upward)}")
    for source, target in upward:
        print(f"  UP: {source} -> {target} ({arrows[(source, target)]} imports)")
    return 1 if upward else 0


if __name__ == "__main__":
    sys.exit(main())
