"""``dsopt trace STUDY``: the study's own model traced on fake tensors, beside the activation formula."""

from __future__ import annotations

import argparse
import json

from optimizer.cli.common import counted, inventory_json, runnable_model
from optimizer.study.study_file import load_study


def run(args: argparse.Namespace) -> int:
    from launchers.trace.study_traces import trace_rows

    study = load_study(args.study)
    runnable_model(study, what="trace")
    study = counted(study)
    rows = trace_rows(study=study)
    if args.json:
        print(json.dumps({"study": study.name, "inventory": inventory_json(study), "rows": rows}, indent=2))
        return 0
    if study.model.inventory is not None:
        print("\n".join([*study.model.inventory.summary_lines(), ""]))
    print(f"study {study.name}: one micro-batch ({study.training.micro_batch_size} x "
          f"{study.training.sequence_length} tokens) forward + backward on fake tensors; MB = 10^6 bytes")
    print("peak: high-water mark of activations + temporaries (traced) vs Korthikanti's stored + one recomputed "
          "block (formula); kept: live when forward ends, in the blocks / outside them (embeddings, head, loss)")
    print("| checkpointing | precision | peak traced MB (phase) | formula MB | difference | "
          "kept in blocks traced / formula MB | kept outside traced / formula MB | "
          "trainable parameters traced / ledger |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        if row["source"] != "trace":
            failure = row["failure"]
            print(f"| {row['checkpointing']} | {row['precision']} | - | {row['formula_bytes'] / 1e6:.3f} | - | "
                  f"- | - | warning: trace failed at {failure['op']} ({failure['message'][:80]}); "
                  "the formula is used |")
            continue
        diff = (row["activation_peak_bytes"] - row["formula_bytes"]) / row["formula_bytes"]
        print(f"| {row['checkpointing']} | {row['precision']} | {row['activation_peak_bytes'] / 1e6:.3f} "
              f"({row['peak_phase']}) | {row['formula_bytes'] / 1e6:.3f} | {diff:+.1%} | "
              f"{row['blocks_stored_bytes'] / 1e6:.3f} / "
              f"{row['formula_blocks_stored_bytes'] / 1e6:.3f} | {row['outside_blocks_bytes'] / 1e6:.3f} / "
              f"{row['formula_outside_blocks_bytes'] / 1e6:.3f} | {row['parameters']:,} / "
              f"{row['formula_parameters']:,} |")
    traced = [row for row in rows if row["source"] == "trace"]
    if traced:
        print("\nkept when forward ends, by the op that made each tensor (MB; aten.clone: contiguous copies, "
              "aten.empty_like: CPU dropout masks in the input's dtype):")
    for row in traced:
        ops = ", ".join(f"{op} {size / 1e6:.3f}" for op, size in list(row["kept_by_op"].items())[:8])
        print(f"  {row['checkpointing']} {row['precision']}: {ops}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser("trace", help="activations of the study's own model on fake tensors, beside the formula")
    trace.add_argument("study", help="study file with a transformer-mode model")
    trace.add_argument("--json", action="store_true", help="print JSON (integer bytes)")
    trace.set_defaults(run=run)
