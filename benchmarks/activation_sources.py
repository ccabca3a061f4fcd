"""Formula or trace: which activation source predicts the measured peak better.

    python benchmarks/activation_sources.py [GRID.json ...]

Default: benchmarks/data/grid-cpu.json (the built-in tiny GPT, 84 real runs),
benchmarks/data/grid-llama-cpu.json (a 4-layer GQA Llama, 84 real runs) and
benchmarks/data/llama-tiny-cpu.json (a transformers Llama from a local config: SwiGLU, RMSNorm, GQA, rotary;
recorded with ``python benchmarks/record_grid.py studies/llama-tiny-cpu.yaml --out
benchmarks/data/llama-tiny-cpu.json``), then the transformers families of ``benchmarks/hf_families.py --record``
(``benchmarks/data/families/*.json``: gpt2, qwen2, gemma, gemma2, phi3, mixtral, opt; ZeRO 0 and 3, fp32 and
bf16). For every measured run of a recorded grid it computes the ledger
twice — activations from the formula and from the trace (``dsopt trace``'s figures, cached by content in
dsopt's cache folder) — and prints each prediction's error against the measured per-rank peak, then a summary.

What is compared: on CPU ranks the measured peak is the live-tensor peak of the rank's process (PyTorch
profiler), so the ledger's prediction is its per-rank host-RAM peak, device and host items together (the
offloaded optimizer lives in the same memory). Everything but the activation lines is the same in both
ledgers, so the difference between the two errors is the activation source's. Prints figures; asserts
nothing.

Then, for each study, the per-block bytes a block keeps for backward: Korthikanti's GPT-2 expression
applied blindly (``sbh(34 + 5as/h)`` at 16 bits), dsopt's formula generalised term by term, and the trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from launchers.trace.inventory import with_inventory
from launchers.trace.study_traces import trace_rows, with_traced_activations
from optimizer.ledger.core import compute_ledger
from optimizer.ledger.transformer import layer_terms
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import ActivationSource, baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = (ROOT / "benchmarks" / "data" / "grid-cpu.json", ROOT / "benchmarks" / "data" / "grid-llama-cpu.json",
           ROOT / "benchmarks" / "data" / "llama-tiny-cpu.json",
           *sorted(p for p in (ROOT / "benchmarks" / "data" / "families").glob("*.json")
                   if not p.name.endswith(".config.json")))
"""The recorded grids, then every family's runs recorded by ``benchmarks/hf_families.py --record``."""


def per_rank_prediction(ledger) -> int:
    """What one rank's process holds at its peak, as the ledger predicts it (CPU ranks: host + device items)."""
    return ledger.peak_bytes_at(ledger.host_locations) if ledger.device_is_host else ledger.per_gpu()["total"]


def compare(grid: Path) -> dict[str, list[float]]:
    data = json.loads(grid.read_text())
    study = with_inventory(load_study(ROOT / data["study_file"]))  # parameters as the model's code builds them
    sources = {name: dataclasses.replace(study.model, activations=source)
               for name, source in (("formula", ActivationSource.FORMULA), ("trace", ActivationSource.TRACE))}
    sources["trace"] = with_traced_activations(dataclasses.replace(study, model=sources["trace"])).model
    errors: dict[str, list[float]] = {"formula": [], "trace": []}
    print(f"\n## {study.name}: {grid.relative_to(ROOT)} ({data['machine']['cpu']}, torch "
          f"{data['machine']['versions']['torch']}, deepspeed {data['machine']['versions']['deepspeed']})\n")
    print("| candidate | measured MB | formula MB | error | trace MB | error |")
    print("|---|---|---|---|---|---|")
    for entry in data["candidates"]:
        measured = entry.get("measured_peak_bytes")
        if not measured:
            continue
        candidate = with_knobs(baseline_candidate(study.training), entry["knobs"])
        row = [entry["label"], f"{measured / 1e6:.3f}"]
        for name, model in sources.items():
            ledger = compute_ledger(candidate=candidate, model=model, hardware=study.hardware,
                                    training=study.training)
            predicted = per_rank_prediction(ledger)
            errors[name].append((predicted - measured) / measured)
            row += [f"{predicted / 1e6:.3f}", f"{errors[name][-1]:+.1%}"]
        print("| " + " | ".join(row) + " |")
    return errors


def summary(name: str, errors: dict[str, list[float]]) -> None:
    closer = sum(abs(t) < abs(f) for f, t in zip(errors["formula"], errors["trace"], strict=True))
    ties = sum(abs(t) == abs(f) for f, t in zip(errors["formula"], errors["trace"], strict=True))
    print(f"\n{name}: {len(errors['trace'])} measured runs; trace closer in {closer}, tie in {ties}")
    for source, values in errors.items():
        absolute = [abs(v) for v in values]
        print(f"  {source:<8} median |error| {statistics.median(absolute):.1%}, mean error "
              f"{statistics.mean(values):+.1%}, max |error| {max(absolute):.1%}, under-predicted "
              f"{sum(v < 0 for v in values)} of {len(values)}")


def per_block(study_file: Path) -> None:
    """The bytes one block keeps for backward (no checkpointing, 16-bit where the space has it)."""
    study = load_study(study_file)
    model, seq, b = study.model, study.training.sequence_length, study.training.micro_batch_size
    rows = [row for row in trace_rows(study=study)
            if row["checkpointing"] == "none" and row["source"] == "trace"]
    print(f"\n{study.name}: one block's kept activations, b = {b}, s = {seq}, h = {model.hidden_size}, "
          f"a = {model.heads}, f = {model.ffn_size}, kv heads = {model.kv_heads} (MB = 10^6 bytes)")
    for row in rows:
        p = 4 if row["precision"] == "fp32" else 2
        sbh, a = seq * b * model.hidden_size, model.heads
        gpt2 = sbh * (34 + 5 * a * seq / model.hidden_size) * p / 2
        ours = sum(t.bytes for t in layer_terms(model, seq=seq, micro_batch=b, element_bytes=p))
        traced = row["blocks_stored_bytes"] / row["blocks"]
        print(f"  {row['precision']}: GPT-2 expression {gpt2 / 1e6:.3f}, dsopt formula {ours / 1e6:.3f}, "
              f"trace {traced / 1e6:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grids", nargs="*", default=[str(p) for p in DEFAULT])
    args = parser.parse_args()
    for grid in map(Path, args.grids):
        if not grid.exists():
            print(f"{grid}: not recorded (see the module doc for the command)", file=sys.stderr)
            continue
        errors = compare(grid.resolve())
        summary(json.loads(grid.read_text())["study"], errors)
        per_block(ROOT / json.loads(grid.read_text())["study_file"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
