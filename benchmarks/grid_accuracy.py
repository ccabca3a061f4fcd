"""Benchmark: today's ledger against a recorded grid's real runs, candidate by candidate.

    python benchmarks/grid_accuracy.py benchmarks/data/grid-lora-gpt2-cpu.json [more grids ...]

For every candidate of a grid (benchmarks/record_grid.py) that ran: the measured per-rank peak (on CPU ranks the
live-tensor peak of one memory), the ledger's per-rank prediction — computed now from the grid's study file, as
``dsopt study run`` computes it (its inventory where it trains in part, its traced activations; device + host items
on CPU ranks, as record_grid.py records them) — and the difference in per cent of the measured peak. Then, per
grid: how many are within 3 % and 1 %, the median and the largest |difference|. ``--phase training`` compares
training's peak alone (a QLoRA grid: dsopt's own trial builds the 16-bit model before it quantizes, an init a
user's ``from_pretrained`` does not have). Prints Markdown; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from launchers.trace.inventory import adapted_inventory
from launchers.trace.study_traces import with_traced_activations
from optimizer.ledger.core import evaluate
from optimizer.search.ordering import candidate_of
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[1]


def rows(grid: dict, *, phase: str = "peak") -> list[tuple[str, int, int, float]]:
    """(label, measured, predicted, difference %) of every candidate that completed; ``phase`` ``training``:
    training's peak alone on both sides (the init phase left out: ``training_peak_bytes`` against the ledger's
    ``training_bytes``)."""
    study = with_traced_activations(adapted_inventory(load_study(ROOT / grid["study_file"])))
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}
    base = baseline_candidate(study.training)
    out = []
    for entry in grid["candidates"]:
        measured = entry.get("training_peak_bytes" if phase == "training" else "measured_peak_bytes")
        if entry.get("outcome") != "ok" or not measured:
            continue
        ledger = evaluate(candidate=candidate_of(entry["knobs"], base), **spec).ledger
        assert ledger is not None, entry["label"]
        device = ledger.per_gpu()["total"]
        predicted = ledger.host_bytes // ledger.ranks_per_node if ledger.device_is_host else device
        if phase == "training":
            predicted = ledger.training_bytes
        out.append((entry["label"], measured, predicted, 100.0 * (predicted - measured) / measured))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grids", nargs="+", type=Path)
    parser.add_argument("--phase", choices=("peak", "training"), default="peak",
                        help="the whole run's peak (default), or training's alone (the init phase left out)")
    args = parser.parse_args()
    for path in args.grids:
        grid = json.loads(path.read_text())
        table = rows(grid, phase=args.phase)
        what = "training's peak alone, " if args.phase == "training" else ""
        print(f"\n{path.name} ({grid['study']}, {grid['machine'].get('cpu', '')}; {what}MB = 10^6 bytes)\n")
        print("| candidate | measured MB | ledger MB | difference |")
        print("|---|---|---|---|")
        for label, measured, predicted, diff in table:
            print(f"| {label} | {measured / 1e6:.3f} | {predicted / 1e6:.3f} | {diff:+.1f} % |")
        diffs = [abs(d) for *_, d in table]
        if not diffs:
            print("no completed candidate")
            continue
        print(f"\n{len(table)} ran of {len(grid['candidates'])}: within 3 %: {sum(d <= 3 for d in diffs)}, "
              f"within 1 %: {sum(d <= 1 for d in diffs)}; median |difference| {statistics.median(diffs):.2f} %, "
              f"largest {max(diffs):.2f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
