"""Benchmark: real trials of a few candidates, measured peak vs the ledger, tokens/s, loss fidelity.

    python benchmarks/trial_table.py [STUDY.yaml] [--set-list 'zero_stage=1' 'zero_stage=2,precision=bf16' ...]

Default: studies/cpu-tiny.yaml (2 CPU ranks), ZeRO 0–3 in fp32, ZeRO-2 bf16, ZeRO-1 with CPU optimizer
offload, and full checkpointing. Prints a Markdown table. On CPU ranks the measured peak is the live-tensor
peak and the prediction compared with it is the ledger's per-rank total of device and host items (one
memory); on CUDA it is max_memory_allocated against the ledger's per-GPU total. Asserts nothing.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

from launchers.trial.run import check_devices, reference_losses, run_trial
from optimizer.ledger.core import compute_ledger
from optimizer.results.trial_report import trial_json
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SETS = ["zero_stage=0", "zero_stage=1", "zero_stage=2", "zero_stage=3", "zero_stage=2,precision=bf16",
                "zero_stage=1,offload_optimizer=cpu", "zero_stage=2,checkpointing=full"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", nargs="?", default=str(ROOT / "studies" / "cpu-tiny.yaml"))
    parser.add_argument("--set-list", nargs="+", default=DEFAULT_SETS,
                        help="candidates, each as comma-separated knob=value pairs")
    args = parser.parse_args()
    study = load_study(args.study)
    check_devices(study)
    reference = reference_losses(study)
    print(f"study {study.name}; {study.hardware.gpus_per_node} {study.hardware.accelerator} rank(s); "
          f"{platform.processor() or platform.machine()}, Python {platform.python_version()}; MB = 10^6 bytes\n")
    print("| candidate | outcome | measured peak MB (max rank) | ledger MB | error | tokens/s | loss fidelity |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.set_list:
        knobs = dict(pair.split("=", 1) for pair in spec.split(","))
        candidate = with_knobs(baseline_candidate(study.training), knobs)
        ledger = compute_ledger(candidate=candidate, model=study.model, hardware=study.hardware,
                                training=study.training)
        result = run_trial(study=study, candidate=candidate, reference_losses=reference)
        data = trial_json(result=result, ledger=ledger, tolerance=study.trial.tolerance(candidate.precision),
                          trial_dir="", study=study.name)
        measured, predicted = data["peak_memory_bytes"], data["predicted_rank_bytes"]
        error = "-" if not measured else f"{(predicted - measured) / measured:+.1%}"
        tokens = "-" if data["tokens_per_s"] is None else f"{data['tokens_per_s']:,.0f}"
        fidelity = "-" if data["loss_fidelity"] is None else f"{data['loss_fidelity']:.1e}"
        print(f"| {candidate.label()} | {data['outcome']} | {(measured or 0) / 1e6:.3f} | {predicted / 1e6:.3f} | "
              f"{error} | {tokens} | {fidelity} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
