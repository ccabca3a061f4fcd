"""Model construction at the largest size this machine allows: real 2-rank CPU trials, init peaks vs the ledger.

A built-in GPT of a few hundred million parameters (default 24 × 1024, vocab 8192: 311 M) is trained for three
steps on 2 CPU ranks with real DeepSpeed, at ZeRO-3 (zero.Init, with and without parameter offload, and built
whole for contrast) and at ZeRO-2 in bf16 (built on the device in bf16, and built whole in FP32). Each trial's
rank reports give the construction's peak and the init phase's peak (live tensors,
:mod:`launchers.measure.cpu_memory`);
the ledger gives its prediction of both (:mod:`optimizer.ledger.init_phase`). Prints one markdown table.

    .venv/bin/python benchmarks/init_scale.py [--layers 24 --hidden 1024 --vocab 8192] [--cases scale|every]
    .venv/bin/python benchmarks/init_scale.py --layers 4 --hidden 256 --vocab 4096 --cases every  # 4.2 M, ~8 min

About 2.5 GB of RAM per rank and a few minutes per trial on 2 cores. On CPU ranks the device and the host are
one memory, so each figure is the rank's whole live-tensor peak.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launchers.trial.run import run_trial  # noqa: E402
from optimizer.ledger.core import compute_ledger  # noqa: E402
from optimizer.ledger.model_states import construction_bytes  # noqa: E402
from optimizer.ledger.transformer import parameter_count, zero3_partition_elements  # noqa: E402
from optimizer.results.trial_result import Outcome  # noqa: E402
from optimizer.study.knobs import with_knobs  # noqa: E402
from optimizer.study.specs import baseline_candidate  # noqa: E402
from optimizer.study.study_file import StudySpec, load_study  # noqa: E402

CASES = (
    ("auto", {"zero_stage": 3}),
    ("auto", {"zero_stage": 3, "offload_param": "cpu"}),
    ("full", {"zero_stage": 3}),
    ("auto", {"zero_stage": 2, "precision": "bf16"}),
    ("full", {"zero_stage": 2, "precision": "bf16"}),
)
"""(training.model_init, knobs) of each trial: ``--cases scale``, the default."""

EVERY_STAGE = (
    {"zero_stage": 0}, {"zero_stage": 0, "precision": "bf16"}, {"zero_stage": 1, "precision": "bf16"},
    {"zero_stage": 2, "precision": "bf16"}, {"zero_stage": 2}, {"zero_stage": 2, "precision": "bf16",
                                                                "offload_optimizer": "cpu"},
    {"zero_stage": 3}, {"zero_stage": 3, "precision": "bf16"},
    {"zero_stage": 3, "precision": "bf16", "offload_optimizer": "cpu", "offload_param": "cpu"},
)
"""``--cases every``: each stage and offload path, each built both ways (for a small model: minutes)."""


def _study(folder: Path, *, model_init: str, layers: int, hidden: int, vocab: int) -> StudySpec:
    raw = {
        "name": f"init-scale-{model_init}",
        "model": {"kind": "transformer", "layers": layers, "hidden_size": hidden, "heads": hidden // 64,
                  "vocab_size": vocab, "tied_embeddings": True, "attention": "fused", "dropout": False},
        "hardware": {"accelerator": "cpu", "gpus_per_node": 2, "gpu_memory": "10 GiB", "host_memory": "24 GiB"},
        "training": {"global_batch_size": 2, "micro_batch_size": 1, "sequence_length": 64,
                     "model_init": model_init},
        "trial": {"warmup_steps": 2, "measured_steps": 1, "timeout_s": 1800},
        "search_space": {"knobs": {"zero_stage": [2, 3]}},
    }
    path = folder / f"init-scale-{model_init}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_study(path)


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--cases", choices=("scale", "every"), default="scale",
                        help="scale: the ZeRO-3/ZeRO-2 contrast (default); every: each stage × auto and full")
    args = parser.parse_args()
    cases = CASES if args.cases == "scale" else tuple((init, knobs) for knobs in EVERY_STAGE
                                                      for init in ("auto", "full"))
    with tempfile.TemporaryDirectory(prefix="dsopt-init-scale-") as tmp:
        folder = Path(tmp)
        studies = {init: _study(folder, model_init=init, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
                   for init in ("auto", "full")}
        model = studies["auto"].model
        psi = parameter_count(model)
        q = zero3_partition_elements(model, ranks=2)
        print(f"{datetime.date.today()} · {platform.processor() or platform.machine()} · GPT {args.layers} × "
              f"{args.hidden}, vocab {args.vocab}: Ψ = {psi:,} parameters (FP32 model {_mb(4 * psi)} MB, ZeRO-3 "
              f"partition Q = {q:,} elements, {_mb(4 * q)} MB in FP32) · 2 CPU ranks · MB = 10^6 bytes\n")
        print("| candidate | model_init → construction | build peak (ledger) MB | init peak (ledger) MB | "
              "init error | init s | step s |")
        print("|---|---|---|---|---|---|---|")
        for model_init, knobs in cases:
            study = studies[model_init]
            candidate = with_knobs(baseline_candidate(study.training), knobs)
            result = run_trial(study=study, candidate=candidate)
            label = candidate.label()
            if result.outcome is not Outcome.OK:
                print(f"| {label} | {model_init} | {result.outcome}: {result.message[:80]} | | | | |")
                continue
            ledger = compute_ledger(candidate=candidate, model=study.model, hardware=study.hardware,
                                    training=study.training)
            built = max(r.build_peak_allocated_bytes or 0 for r in result.ranks)
            predicted_build = construction_bytes(candidate=candidate, model=study.model, hardware=study.hardware,
                                                 training=study.training)
            init = result.init_peak_memory_bytes or 0
            error = (ledger.init_bytes - init) / init
            print(f"| {label} | {model_init} → {result.ranks[0].construction} | {_mb(built)} ({_mb(predicted_build)})"
                  f" | {_mb(init)} ({_mb(ledger.init_bytes)}) | {error:+.1%} | {result.init_s:.1f} | "
                  f"{result.step_time_s:.1f} |")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
