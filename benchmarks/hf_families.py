"""Causal-LM families beyond Llama, trained for real: each family's tiny config on 2 CPU ranks vs the ledger.

    .venv/bin/python benchmarks/hf_families.py [--families gpt2,qwen2,...] [--candidates z0-fp32,z3-bf16,...]

For every family of ``tests/data/hf_families.json`` (tiny versions of gpt2, qwen2, gemma, gemma2, phi3, mixtral, opt
built by transformers from local configs, nothing downloaded) and each candidate (ZeRO 0 and 3 × fp32 and
bf16), one real DeepSpeed trial on 2 CPU ranks (:func:`launchers.trial.run.run_trial`, as ``dsopt trial``) measures
the per-rank live-tensor peak of training (from the first step) and of the init phase. Beside it, the ledger's
predictions with the parameter inventory (the model itself) and activations from the trace and from the formula.
Prints one markdown table and the errors' summary; asserts nothing. About 15-25 s per trial on 2 cores.

``--record`` also writes each family's study (``benchmarks/data/families/FAMILY.yaml`` and its config.json) and
its runs in ``benchmarks/record_grid.py``'s format (``benchmarks/data/families/FAMILY.json``), which
``benchmarks/activation_sources.py`` compares formula and trace over.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from record_grid import machine  # noqa: E402

from launchers.trace.inventory import with_inventory  # noqa: E402
from launchers.trace.study_traces import with_traced_activations  # noqa: E402
from launchers.trial.run import run_trial  # noqa: E402
from optimizer.deepspeed.versions import installed_versions  # noqa: E402
from optimizer.ledger.core import compute_ledger  # noqa: E402
from optimizer.results.trial_result import Outcome  # noqa: E402
from optimizer.study.knobs import with_knobs  # noqa: E402
from optimizer.study.specs import ActivationSource, baseline_candidate  # noqa: E402
from optimizer.study.study_file import StudySpec, load_study  # noqa: E402

RECORDED = ROOT / "benchmarks" / "data" / "families"

CANDIDATES = {"z0-fp32": {"zero_stage": 0}, "z0-bf16": {"zero_stage": 0, "precision": "bf16"},
              "z3-fp32": {"zero_stage": 3}, "z3-bf16": {"zero_stage": 3, "precision": "bf16"}}


def _families() -> dict[str, dict]:
    """The tiny configs of tests/data/hf_families.json (the families the tests check)."""
    data = json.loads((ROOT / "tests" / "data" / "hf_families.json").read_text())
    return {name: entry["config"] for name, entry in data.items()}


def _study(folder: Path, family: str, config: dict) -> StudySpec:
    (folder / f"{family}.config.json").write_text(json.dumps(config))
    raw = {"name": f"family-{family}",
           "model": {"kind": "transformer", "hf_config": f"{family}.config.json",
                     "attention": "eager", "activations": "trace"},
           "hardware": {"accelerator": "cpu", "gpus_per_node": 2, "gpu_memory": "8 GiB", "host_memory": "24 GiB"},
           "training": {"global_batch_size": 4, "micro_batch_size": 2, "sequence_length": 64},
           "trial": {"warmup_steps": 2, "measured_steps": 2},
           "search_space": {"knobs": {"zero_stage": [0, 3], "precision": ["fp32", "bf16"]}}}
    path = folder / f"{family}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return with_traced_activations(with_inventory(load_study(path)))


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.3f}"


def main() -> int:
    families = _families()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(families))
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--record", action="store_true", help=f"write the studies and runs under {RECORDED}")
    args = parser.parse_args()
    versions = installed_versions()
    print(f"{datetime.date.today()} · {platform.machine()} · 2 CPU ranks · torch {versions['torch']}, deepspeed "
          f"{versions['deepspeed']}, transformers {versions['transformers']} · MB = 10^6 bytes; error = "
          "(ledger − measured) / measured\n")
    print("| family | Ψ (inventory) | candidate | outcome | training measured MB | ledger, trace | error | "
          "ledger, formula | error | init measured MB | ledger | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {"trace": [], "formula": [], "init": []}
    with tempfile.TemporaryDirectory(prefix="dsopt-families-") as tmp:
        for family in args.families.split(","):
            folder = RECORDED if args.record else Path(tmp)
            folder.mkdir(parents=True, exist_ok=True)
            study = _study(folder, family, families[family])
            runs: list[dict] = []
            formula = dataclasses.replace(study.model, activations=ActivationSource.FORMULA)
            psi = study.model.inventory.parameters if study.model.inventory else None
            for name in args.candidates.split(","):
                candidate = with_knobs(baseline_candidate(study.training), CANDIDATES[name])
                result = run_trial(study=study, candidate=candidate)
                runs.append({"label": name, "knobs": CANDIDATES[name], "outcome": str(result.outcome),
                             "measured_peak_bytes": result.training_peak_memory_bytes
                             if result.outcome is Outcome.OK else None})
                if result.outcome is not Outcome.OK:
                    print(f"| {family} | {psi or '-':,} | {name} | {result.outcome}: {result.message[:80]} |"
                          " | | | | | | | |")
                    continue
                spec = {"hardware": study.hardware, "training": study.training}
                traced = compute_ledger(candidate=candidate, model=study.model, **spec)
                shaped = compute_ledger(candidate=candidate, model=formula, **spec)
                measured = result.training_peak_memory_bytes
                init = result.init_peak_memory_bytes
                row = {"trace": traced.training_bytes, "formula": shaped.training_bytes, "init": traced.init_bytes}
                err = {"trace": (row["trace"] - measured) / measured, "formula": (row["formula"] - measured) / measured,
                       "init": (row["init"] - init) / init}
                for key, value in err.items():
                    errors[key].append(value)
                print(f"| {family} | {psi:,} | {name} | ok | {_mb(measured)} | {_mb(row['trace'])} | "
                      f"{err['trace']:+.1%} | {_mb(row['formula'])} | {err['formula']:+.1%} | {_mb(init)} | "
                      f"{_mb(row['init'])} | {err['init']:+.1%} |")
                sys.stdout.flush()
            if args.record:
                grid = {"study": study.name, "study_file": str(study.path.relative_to(ROOT)),
                        "command": " ".join(sys.argv), "started": str(datetime.date.today()), "machine": machine(),
                        "candidates": runs}
                (RECORDED / f"{family}.json").write_text(json.dumps(grid, indent=1) + "\n")
    print()
    for key, values in errors.items():
        if values:
            absolute = [abs(v) for v in values]
            print(f"{key}: {len(values)} runs, median |error| {statistics.median(absolute):.1%}, max "
                  f"{max(absolute):.1%}, within 5 %: {sum(a <= 0.05 for a in absolute)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
