"""One GPU check, ready to run: a small grid of real trials on this machine's CUDA devices, ledger beside measured.

    python benchmarks/gpu_check.py             # on any CUDA machine: about 5-8 minutes on one H100/H200
    python benchmarks/gpu_check.py --dry-run   # the same pipeline on 2 CPU ranks with tiny shapes (what CI runs)

The grid: a built-in GPT of ~150 M parameters (12 × 768, SwiGLU, RMSNorm, RoPE, vocab 32000) at ZeRO 0/2/3 ×
bf16/fp16 × checkpointing none/full on all visible GPUs (up to 8), two of them again on 1 GPU when there are
several, and a transformers Llama config (8 × 1024, 16 heads, 4 KV heads, ~200 M) at ZeRO 0/3 × bf16/fp16. Each
row: the ledger's training and init peaks per GPU against the measured ones (allocated and reserved —
training's from the first step after ``deepspeed.initialize``), tokens/s, fp16 overflow steps (skipped and
replayed, not timed) and the loss fidelity against the FP32 reference. Then the fastest ZeRO-3 Llama
candidate (else the fastest) is exported with ``--hf`` and trained under the Hugging Face Trainer
(``launchers/workloads/hf_trainer_rank.py``), which must build it partitioned at stage 3 and train a falling loss.

``--dry-run`` runs it all on 2 CPU ranks (``DS_ACCELERATOR=cpu``) with tiny shapes and bf16 only (fp16 rows
are kept: DeepSpeed's CPU accelerator refuses fp16 on most CPUs, which the row records as ``unsupported``);
the Trainer part runs on one CPU rank in FP32 (the Trainer's CPU mode gives DeepSpeed one process).
Stops launching once ``--minutes`` have passed and says which rows it skipped. Prints markdown.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launchers.local import LAUNCH_ID_VAR, LaunchPlan, execute, extensions_dir, log_tail  # noqa: E402
from launchers.trial import ReferenceFailed, reference_losses, run_trial  # noqa: E402
from optimizer.ledger.core import compute_ledger  # noqa: E402
from optimizer.results.export import exported_config  # noqa: E402
from optimizer.results.trial_result import Outcome, TrialResult  # noqa: E402
from optimizer.study.knobs import with_knobs  # noqa: E402
from optimizer.study.specs import baseline_candidate  # noqa: E402
from optimizer.study.study_file import StudySpec, load_study  # noqa: E402

MB = 10**6
GPT = {"kind": "transformer", "layers": 12, "hidden_size": 768, "heads": 12, "vocab_size": 32000,
       "tied_embeddings": False, "attention": "fused", "mlp": "swiglu", "norm": "rmsnorm", "bias": False,
       "position_embedding": "rope", "dropout": False}
LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
         "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
         "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
         "torch_dtype": "float16"}  # as Llama-2's config.json says: the candidates' dtype must win
DRY_GPT = {**GPT, "layers": 2, "hidden_size": 64, "heads": 4, "vocab_size": 256}
DRY_LLAMA = {**LLAMA, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def _grid(gpus: int) -> list[tuple[str, int, dict[str, Any]]]:
    """(model, GPUs, knobs) of each row."""
    rows = [("gpt", gpus, {"zero_stage": stage, "precision": precision, "checkpointing": ckpt})
            for stage in (0, 2, 3) for precision in ("bf16", "fp16") for ckpt in ("none", "full")]
    if gpus > 1:
        rows += [("gpt", 1, {"zero_stage": 0, "precision": "bf16"}), ("gpt", 1, {"zero_stage": 3, "precision": "bf16"})]
    rows += [("llama", gpus, {"zero_stage": stage, "precision": precision})
             for stage in (0, 3) for precision in ("bf16", "fp16")]
    return rows


def _study(folder: Path, *, model: str, gpus: int, dry: bool) -> StudySpec:
    name = f"gpu-check-{model}-{gpus}"
    if model == "llama":
        (folder / "llama.config.json").write_text(json.dumps(DRY_LLAMA if dry else LLAMA))
        model_spec: dict[str, Any] = {"kind": "transformer", "hf_config": "llama.config.json", "attention": "fused"}
    else:
        model_spec = DRY_GPT if dry else GPT
    micro = 2 if dry else 4
    raw = {
        "name": name,
        "model": model_spec,
        "hardware": {"accelerator": "cpu" if dry else "cuda", "gpus_per_node": gpus,
                     "gpu_memory": "2 GiB" if dry else f"{_device_memory_gib():.0f} GiB",
                     "device_reserve": "0 GiB" if dry else "1 GiB",
                     **({"supported_precisions": ["fp32", "bf16", "fp16"]} if dry else {})},
        "training": {"global_batch_size": micro * gpus, "micro_batch_size": micro,
                     "sequence_length": 64 if dry else 1024},
        "trial": {"warmup_steps": 2, "measured_steps": 3, "timeout_s": 600},
        "search_space": {"knobs": {"zero_stage": [0, 2, 3], "precision": ["bf16", "fp16"],
                                   "checkpointing": ["none", "full"]}},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_study(path)


def _device_memory_gib() -> float:
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**30


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / MB:,.0f}" if value >= 10 * MB else f"{value / MB:,.2f}"


def _row(model: str, gpus: int, study: StudySpec, knobs: dict[str, Any], result: TrialResult) -> str:
    candidate = with_knobs(baseline_candidate(study.training), knobs)
    label = f"{model} ×{gpus} {candidate.label()}"
    if result.outcome is not Outcome.OK:
        return f"| {label} | {result.outcome} | {result.message[:90]} | | | | | | |"
    ledger = compute_ledger(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)
    fidelity = "-" if result.loss_fidelity is None else f"{result.loss_fidelity:.1e}"
    return (f"| {label} | ok | {_mb(ledger.training_bytes)} | {_mb(result.training_peak_memory_bytes)} / "
            f"{_mb(result.training_peak_reserved_bytes)} | {_mb(ledger.init_bytes)} | "
            f"{_mb(result.init_peak_memory_bytes)} / {_mb(result.init_peak_reserved_bytes)} | "
            f"{result.tokens_per_s or 0:,.0f} | {result.skipped_steps} | {fidelity} |")


def _hf_trainer(folder: Path, study: StudySpec, knobs: dict[str, Any], *, dry: bool) -> str:
    """Export ``knobs`` with ``--hf`` and train it under the HF Trainer; one line saying what happened."""
    precision = "fp32" if dry else knobs.get("precision", "bf16")
    config = exported_config(spec=study, knobs={**knobs, "precision": precision}, hf=True)
    config_path = folder / "ds_config.hf.json"
    config_path.write_text(json.dumps(config, indent=2))
    ranks = 1 if dry else study.hardware.gpus_per_node
    out = folder / "hf_trainer.json"
    argv = (sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(ranks),
            "--master_addr", "127.0.0.1", "--master_port", str(29600 + os.getpid() % 1000),
            "-m", "launchers.workloads.hf_trainer_rank", "--ds-config", str(config_path),
            "--hf-config", str(folder / "llama.config.json"), "--precision", precision,
            "--micro-batch", str(study.training.micro_batch_size), "--sequence-length",
            str(study.training.sequence_length), "--steps", "5", "--out", str(out), *(["--cpu"] if dry else []))
    env = {**os.environ, "PYTHONPATH": str(ROOT), LAUNCH_ID_VAR: uuid.uuid4().hex,
           "TORCH_EXTENSIONS_DIR": str(extensions_dir()), **({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
                                                               if dry else {})}
    log = folder / "hf_trainer.log"
    run = execute(LaunchPlan(argv=argv, env=env, cwd=str(ROOT)), timeout_s=600, log_path=log)
    if run.returncode != 0 or not out.exists():
        return f"HF Trainer run failed (exit {run.returncode}, timed out {run.timed_out}):\n{log_tail(log)[-1500:]}"
    data = json.loads(out.read_text())
    losses = data["losses"]
    falling = len(losses) >= 2 and losses[-1] < losses[0]
    return (f"HF Trainer with the `--hf` export of {knobs} ({precision}, {ranks} rank(s)): built partitioned "
            f"{data['built_partitioned']}, losses {', '.join(f'{x:.4f}' for x in losses)} "
            f"({'falling' if falling else 'NOT falling'}), peak allocated {_mb(data['peak_allocated_bytes'])} MB, "
            f"reserved {_mb(data['peak_reserved_bytes'])} MB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="2 CPU ranks, tiny shapes (no GPU needed)")
    parser.add_argument("--minutes", type=float, default=7.5, help="stop launching after this long")
    parser.add_argument("--rows", type=int, default=None, help="run only the first N rows (tests)")
    parser.add_argument("--only", choices=("gpt", "llama"), default=None, help="run one model's rows")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the HF Trainer run")
    args = parser.parse_args()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --dry-run to check the pipeline on CPU ranks",
              file=sys.stderr)
        return 2
    gpus = 2 if args.dry_run else min(8, torch.cuda.device_count())
    device = "2 CPU ranks (dry run)" if args.dry_run else \
        f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}"
    started = time.monotonic()
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC · {device} · {platform.node()} · torch "
          f"{torch.__version__} · MB = 10^6 bytes\n")
    print("| model × GPUs, candidate | outcome | ledger train MB | measured train MB alloc / reserved | "
          "ledger init MB | measured init MB alloc / reserved | tokens/s | fp16 skipped | fidelity |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [row for row in _grid(gpus) if args.only in (None, row[0])][:args.rows]
    best: tuple[tuple[bool, float], dict[str, Any]] | None = None
    skipped = []
    with tempfile.TemporaryDirectory(prefix="dsopt-gpu-check-") as tmp:
        folder = Path(tmp)
        studies: dict[tuple[str, int], StudySpec] = {}
        references: dict[tuple[str, int], list[float] | None] = {}
        for model, n, knobs in rows:
            if time.monotonic() - started > args.minutes * 60:
                skipped.append(f"{model} ×{n} {knobs}")
                continue
            if (model, n) not in studies:
                studies[model, n] = _study(folder, model=model, gpus=n, dry=args.dry_run)
                try:
                    references[model, n] = reference_losses(studies[model, n]) if n == gpus else None
                except ReferenceFailed as failed:
                    print(f"| {model} ×{n} FP32 reference | {failed} | | | | | | | |")
                    references[model, n] = None
            study = studies[model, n]
            candidate = with_knobs(baseline_candidate(study.training), knobs)
            result = run_trial(study=study, candidate=candidate, reference_losses=references[model, n])
            print(_row(model, n, study, knobs, result))
            sys.stdout.flush()
            if model == "llama" and n == gpus and result.outcome is Outcome.OK:
                rank = (knobs["zero_stage"] == 3, result.tokens_per_s or 0.0)  # stage 3 shows zero.Init
                if best is None or rank > best[0]:
                    best = (rank, knobs)
        if skipped:
            print(f"\nnot launched (past {args.minutes} min): " + "; ".join(skipped))
        if not args.skip_hf:
            if best is None:
                print("\nHF Trainer run: no Llama candidate measured ok, nothing to export")
            else:
                print("\n" + _hf_trainer(folder, studies["llama", gpus], best[1], dry=args.dry_run))
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
