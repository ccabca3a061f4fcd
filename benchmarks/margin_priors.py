"""Benchmark: the launch margin's priors against today's ledger on recorded grids.

    python benchmarks/margin_priors.py benchmarks/data/grid-*.json

Before a candidate's family has measured its own, the launch margin (``optimizer/search/ordering.py``
``StudyModels.margin_bytes``) keeps free ``MIN_MARGIN``·need + u·estimated + risk, at least ``PRIOR_MARGIN_CPU``·need
on CPU ranks; u is ``ESTIMATE_PRIOR``, or ``ESTIMATE_PRIOR_OFFLOADED`` where the optimizer or the parameters live on
the host. For every candidate of each grid that ran (benchmarks/record_grid.py), computed now as ``dsopt study run``
computes it: the measured device share of training (its peak, the init phase left out, less the ledger's host items
at that peak: what the study's objective measures, ``optimizer/search/objective.py``); its miss beyond
``MIN_MARGIN``·need + risk in units of the estimated bytes (what u must cover); and measured / need − 1 (what the
whole-need prior must cover). Per grid, with and without offload: the worst of each, against the priors. Prints
Markdown; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launchers.trace.inventory import adapted_inventory
from launchers.trace.study_traces import with_traced_activations
from optimizer.ledger.core import evaluate
from optimizer.search.ordering import (
    ESTIMATE_PRIOR,
    ESTIMATE_PRIOR_OFFLOADED,
    MIN_MARGIN,
    PRIOR_MARGIN_CPU,
    candidate_of,
)
from optimizer.study.knobs import OffloadDevice
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[1]


def misses(grid: dict) -> list[tuple[str, bool, float, float]]:
    """(label, offloaded, miss / estimated bytes, measured / need − 1) of every candidate of ``grid`` that ran."""
    study = with_traced_activations(adapted_inventory(load_study(ROOT / grid["study_file"])))
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}
    base = baseline_candidate(study.training)
    out = []
    for entry in grid["candidates"]:
        measured = entry.get("training_peak_bytes") or entry.get("measured_peak_bytes")
        if entry["outcome"] != "ok" or not measured:
            continue
        candidate = candidate_of(entry["knobs"], base)
        ledger = evaluate(candidate=candidate, **spec).ledger
        if ledger is None:
            continue
        need = ledger.training_needed_bytes
        device = measured - ledger.training_host_share_bytes
        miss = device - (1 + MIN_MARGIN) * need - ledger.risk_bytes
        offloaded = (candidate.offload_optimizer, candidate.offload_param) != (OffloadDevice.NONE, OffloadDevice.NONE)
        out.append((entry["label"], offloaded, miss / max(ledger.estimated_bytes, 1), device / need - 1))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grids", nargs="+", type=Path)
    args = parser.parse_args()
    print(f"Priors: estimated share {ESTIMATE_PRIOR} ({ESTIMATE_PRIOR_OFFLOADED} with offload on CPU ranks), "
          f"whole need {PRIOR_MARGIN_CPU} (CPU ranks), beyond MIN_MARGIN {MIN_MARGIN}.\n")
    print("| grid | offload | rows | worst miss / estimated (candidate) | worst measured / need − 1 (candidate) |")
    print("|---|---|---|---|---|")
    for path in args.grids:
        grid = json.loads(path.read_text())
        found = misses(grid)
        for offloaded in (False, True):
            part = [row for row in found if row[1] is offloaded]
            if not part:
                continue
            share = max(part, key=lambda row: row[2])
            whole = max(part, key=lambda row: row[3])
            print(f"| {path.stem} | {'yes' if offloaded else 'no'} | {len(part)} | {share[2]:+.3f} ({share[0]}) | "
                  f"{100 * whole[3]:+.1f} % ({whole[0]}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
