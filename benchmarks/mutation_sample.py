"""Random samples of mutmut's mutants, and the kill rate of a sample with its confidence interval.

    .venv/bin/mutmut results --all true > /tmp/all.txt          # every mutant's name (run `mutmut run` once first)
    python benchmarks/mutation_sample.py draw /tmp/all.txt --seed 28 --size 400 \\
        --exclude benchmarks/data/mutation/seed26.txt benchmarks/data/mutation/seed27.txt > names.txt
    .venv/bin/mutmut run $(cat names.txt)                         # ~2 s a mutant on 2 cores
    .venv/bin/mutmut results --all true > /tmp/now.txt
    python benchmarks/mutation_sample.py rate /tmp/now.txt names.txt

``draw`` leaves out the launch policy and the model-state items (each run whole: docs/benchmarks.md) and every name
in ``--exclude``; the sample is ``random.Random(seed).sample`` of the rest, sorted by name. ``rate`` counts the
sample's outcomes by module; a mutant named in benchmarks/data/mutation/equivalent.txt (each with the reason no input
tells it apart) is left out of the rate, and the interval is Wilson's at 95 % (a binomial proportion from a sample).
Mutant names are numbered within each function, so a sample drawn at one commit names other mutants after an edit to
a sampled function. Prints only.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHOLE = ("optimizer.search.launch_policy.", "optimizer.ledger.model_states.")
"""Run mutant by mutant in full, never sampled."""
EQUIVALENT = ROOT / "benchmarks" / "data" / "mutation" / "equivalent.txt"


def results(path: Path) -> dict[str, str]:
    """``mutmut results --all true`` output: mutant name → status (killed, survived, no tests, timeout, ...)."""
    found = {}
    for line in path.read_text().splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and name.startswith("optimizer."):
            found[name] = status
    return found


def names(path: Path) -> list[str]:
    """One mutant name a line (blank lines and ``#`` comments skipped; a name's first word only)."""
    lines = (line.split("#")[0].split() for line in path.read_text().splitlines())
    return [words[0] for words in lines if words]


def wilson(killed: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's score interval of killed/total (E. B. Wilson, JASA 22 (1927) 209-212)."""
    if total == 0:
        return 0.0, 1.0
    p = killed / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return centre - half, centre + half


def draw(args: argparse.Namespace) -> None:
    excluded = {name for path in args.exclude for name in names(path)}
    population = sorted(n for n in results(args.results) if not n.startswith(WHOLE) and n not in excluded)
    sample = sorted(random.Random(args.seed).sample(population, min(args.size, len(population))))
    print(f"# seed {args.seed}: {len(sample)} of {len(population)} mutants (launch policy, model-state items and "
          f"{len(excluded)} excluded names left out)")
    print("\n".join(sample))


def rate(args: argparse.Namespace) -> None:
    status = results(args.results)
    sample = names(args.sample)
    equivalent = set(names(EQUIVALENT)) if EQUIVALENT.exists() else set()
    by_module: dict[str, Counter[str]] = {}
    for name in sample:
        module = ".".join(name.split(".")[:3])
        outcome = "equivalent" if name in equivalent else status.get(name, "missing")
        by_module.setdefault(module, Counter())[outcome] += 1
    total = Counter[str]()
    print("| module | mutants | killed | equivalent | alive |")
    print("|---|---|---|---|---|")
    for module, counts in sorted(by_module.items()):
        total.update(counts)
        dead = counts["killed"] + counts["timeout"]
        alive = sum(counts.values()) - dead - counts["equivalent"]
        print(f"| {module} | {sum(counts.values())} | {dead} | {counts['equivalent']} | {alive} |")
    killed = total["killed"] + total["timeout"]  # a mutant that hangs the tests is detected (mutmut counts it so)
    judged = sum(total.values()) - total["equivalent"]
    low, high = wilson(killed, judged)
    print(f"\n{killed} of {judged} non-equivalent mutants killed: {100 * killed / max(judged, 1):.1f} % "
          f"(95 % interval {100 * low:.1f}-{100 * high:.1f} %); outcomes {dict(total)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("draw", help="a seeded random sample of mutant names")
    one.add_argument("results", type=Path, help="`mutmut results --all true` output")
    one.add_argument("--seed", type=int, required=True)
    one.add_argument("--size", type=int, default=400)
    one.add_argument("--exclude", type=Path, nargs="*", default=[], help="name files already sampled")
    one.set_defaults(run=draw)
    two = sub.add_parser("rate", help="a sample's kill rate by module")
    two.add_argument("results", type=Path, help="`mutmut results --all true` output")
    two.add_argument("sample", type=Path, help="the sample's names")
    two.set_defaults(run=rate)
    args = parser.parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
