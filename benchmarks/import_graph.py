"""The import graphs of dsopt, drawn from the code (grimp, the graph import-linter checks).

    python benchmarks/import_graph.py   # a Mermaid drawing per layers contract, arrows running back up, file circles

For each ``layers`` contract of pyproject.toml (the packages of the stack; the rooms of ``launchers/``) an arrow is
"A imports B", with how many module-to-module imports make it; the layers are the contract's own order, top first,
where ``A | B`` is one floor of two independent rooms (neither may import the other). An arrow from a lower floor to
a higher one, or between the rooms of one floor, runs against the order: it is listed and the script exits 1
(``lint-imports`` fails on the same imports). Then every **file circle** — modules that import each other in a
loop, imports inside functions included — is listed (exit 1 when there is one). Prints only.
"""

from __future__ import annotations

import sys
import tomllib
from collections import Counter
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def contracts() -> list[tuple[str, list[list[str]]]]:
    """Each layers contract's name and floors, top first (a floor: its independent rooms)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [(c["name"], [[room.strip() for room in floor.split("|")] for floor in c["layers"]])
            for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]


def package_of(module: str, rooms: list[str]) -> str | None:
    """The room a module belongs to (the longest matching prefix), None outside every room."""
    matches = [room for room in rooms if module == room or module.startswith(room + ".")]
    return max(matches, key=len) if matches else None


def draw(graph: grimp.ImportGraph, name: str, floors: list[list[str]]) -> int:
    """One contract's drawing and its arrows against the order; returns how many there are."""
    floor_of = {room: index for index, floor in enumerate(floors) for room in floor}  # 0 = top
    rooms = list(floor_of)
    arrows: Counter[tuple[str, str]] = Counter()
    for module in graph.modules:
        source = package_of(module, rooms)
        for imported in graph.find_modules_directly_imported_by(module):
            target = package_of(imported, rooms)
            if source and target and source != target:
                arrows[(source, target)] += 1
    print(f"\n{name}\n\n```mermaid\nflowchart TD")
    for source, target in sorted(arrows, key=lambda a: (floor_of[a[0]], floor_of[a[1]], a)):
        print(f"  {source.replace('.', '_')}[{source}] -->|{arrows[(source, target)]}| "
              f"{target.replace('.', '_')}[{target}]")
    print("```")
    against = [(s, t) for (s, t) in arrows if floor_of[t] <= floor_of[s]]
    print(f"{len(arrows)} arrows between {len(rooms)} rooms on {len(floors)} floors; against the order: {len(against)}")
    for source, target in against:
        print(f"  AGAINST: {source} -> {target} ({arrows[(source, target)]} imports)")
    return len(against)


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The file circles: strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main() -> int:
    graph = grimp.build_graph("optimizer", "launchers")
    against = sum(draw(graph, name, floors) for name, floors in contracts())
    # a package's __init__ importing its own modules is not a circle of files
    loops = [c for c in circles(graph) if not any(m + "." in n for m in c for n in c)]
    print(f"\nfile circles: {len(loops)}")
    for loop in loops:
        print("  CIRCLE: " + " <-> ".join(loop))
    return 1 if against or loops else 0


if __name__ == "__main__":
    sys.exit(main())
