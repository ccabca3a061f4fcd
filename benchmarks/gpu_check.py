"""One GPU check, ready to run: a small grid of real trials on this machine's CUDA devices, ledger beside measured,
each row asserted.

    python benchmarks/gpu_check.py             # on any CUDA machine: about 6 minutes on one H100/H200 (estimated)
    python benchmarks/gpu_check.py --plan      # the rows, the figure each will check and its band; launches nothing
    python benchmarks/gpu_check.py --dry-run   # the same pipeline on 2 CPU ranks with tiny shapes (what CI runs)

The grid (:func:`_grid`, 12 rows, + 2 on one GPU when there are several): a built-in GPT of ~150 M parameters
(12 × 768, SwiGLU, RMSNorm, RoPE, vocab 32000) at ZeRO 0/2/3 × bf16 × checkpointing none/full and three fp16
rows, and a transformers Llama config (8 × 1024, 16 heads, 4 KV heads, ~200 M) at ZeRO 0/3. Each row is checked
(:func:`verdict`): the ledger's training and init peaks per GPU against the measured allocated ones — the
ledger may read at most :data:`UNDER` below and :data:`OVER` above the measurement, the band printed beside
each figure — and the loss fidelity against an FP32 reference that really ran on the same GPUs (one-GPU rows
included), within the study's tolerance for the precision. The ledger is the one a study plans with: traced
activations (:func:`launchers.trace.study_traces.with_traced_activations`), as ``dsopt study run`` takes them. A
row that is not ``ok``, lacks a figure, or is not launched before ``--minutes`` is a failed row; the script
exits 1 when any row fails. The DeepSpeed ops the grid needs (FusedAdam) are built before the clock starts.
Then the fastest ZeRO-3 Llama candidate (else the fastest) is exported with ``--hf`` and trained under the
Hugging Face Trainer (``launchers/rank/hf_trainer_rank.py``), which must build it partitioned at stage 3
and train a falling loss.

``--dry-run`` runs it all on 2 CPU ranks (``DS_ACCELERATOR=cpu``) with tiny shapes and the same band; an fp16
row on a CPU that DeepSpeed's CPU accelerator refuses fp16 on is reported ``unsupported`` and not counted as a
failure there (only there); the Trainer part runs on one CPU rank in FP32 (the Trainer's CPU mode gives
DeepSpeed one process). Before the rows it prints the probe of the machine's kernels at the first row's shapes
(``dsopt probe``) beside the datasheet of the profile that names the device. Prints markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
import uuid
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launchers.trace.study_traces import with_traced_activations  # noqa: E402
from launchers.trial.local import LAUNCH_ID_VAR, LaunchPlan, execute, extensions_dir, log_tail  # noqa: E402
from launchers.trial.run import ReferenceFailed, reference_losses, run_trial  # noqa: E402
from optimizer.ledger.core import Ledger, compute_ledger  # noqa: E402
from optimizer.results.export import exported_config  # noqa: E402
from optimizer.results.trial_result import Outcome, TrialResult  # noqa: E402
from optimizer.study.knobs import Candidate, Precision, with_knobs  # noqa: E402
from optimizer.study.specs import baseline_candidate  # noqa: E402
from optimizer.study.study_file import StudySpec, load_study  # noqa: E402

MB = 10**6
UNDER = Fraction(5, 100)
"""The ledger may read at most this fraction below a measured peak: an under-count is an OOM on a GPU. Every row
of the dry run (2 CPU ranks) falls within −2.9 %: the largest is an fp16 GEMM temporary of CPU kernels."""
OVER = Fraction(10, 100)
"""The ledger may read at most this fraction above a measured peak (a bound, not a figure, past it)."""
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
Row = tuple[str, int, dict[str, Any]]


def _grid(gpus: int) -> list[Row]:
    """(model, GPUs, knobs) of each row: every stage and checkpointing in bf16, fp16 where its code differs
    (FP16_Optimizer at stage 0, loss scaling under ZeRO-2/3), one GPU, and a transformers model."""
    rows: list[Row] = [("gpt", gpus, {"zero_stage": stage, "precision": "bf16", "checkpointing": ckpt})
                       for stage in (0, 2, 3) for ckpt in ("none", "full")]
    rows += [("gpt", gpus, {"zero_stage": 0, "precision": "fp16", "checkpointing": "none"}),
             ("gpt", gpus, {"zero_stage": 2, "precision": "fp16", "checkpointing": "full"}),
             ("gpt", gpus, {"zero_stage": 3, "precision": "fp16", "checkpointing": "none"})]
    if gpus > 1:
        rows += [("gpt", 1, {"zero_stage": 0, "precision": "bf16"}), ("gpt", 1, {"zero_stage": 3, "precision": "bf16"})]
    rows += [("llama", gpus, {"zero_stage": 0, "precision": "bf16"}),
             ("llama", gpus, {"zero_stage": 3, "precision": "bf16"}),
             ("llama", gpus, {"zero_stage": 3, "precision": "fp16"})]
    return rows


def _study(folder: Path, *, model: str, gpus: int, dry: bool) -> StudySpec:
    """The row's study, with the traced activations a study run plans with."""
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
                     "gpu_memory": "2 GiB" if dry else _device_memory(),
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
    return with_traced_activations(load_study(path))


def _device_memory() -> str:
    """The device's real capacity, rounded down to a MiB (an H100 "80 GB" exposes about 79.6 GiB)."""
    import torch

    return f"{torch.cuda.get_device_properties(0).total_memory // 2**20} MiB"


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / MB:,.0f}" if value >= 10 * MB else f"{value / MB:,.2f}"


def band(ledger_bytes: int, risk_bytes: int = 0) -> tuple[int, int]:
    """The measured peaks a ledger figure agrees with: it may read :data:`UNDER` below, :data:`OVER` above — below
    the figure + ``risk_bytes`` (:attr:`Ledger.risk_bytes`, items live in some runs only) for a run where they were."""
    return math.ceil(ledger_bytes / (1 + OVER)), math.floor((ledger_bytes + risk_bytes) / (1 - UNDER))


def _error(ledger_bytes: int, measured: int | None) -> str:
    return "-" if not measured else f"{(ledger_bytes - measured) / measured:+.1%}"


def verdict(*, ledger: Ledger, result: TrialResult, tolerance: float, fidelity_expected: bool = True) -> list[str]:
    """Why the row fails (empty: it passes): an outcome other than ``ok``, a missing figure, a measured training
    or init peak outside the ledger's :func:`band`, a fidelity missing or above ``tolerance``."""
    if result.outcome is not Outcome.OK:
        return [f"outcome {result.outcome}"]
    problems = []
    for what, predicted, risk, measured in (
            ("training", ledger.training_bytes, ledger.risk_bytes, result.training_peak_memory_bytes),
            ("init", ledger.init_bytes, 0, result.init_peak_memory_bytes)):
        low, high = band(predicted, risk)
        if not measured:
            problems.append(f"no measured {what} peak")
        elif not low <= measured <= high:
            problems.append(f"{what}: ledger {_error(predicted, measured)} off the measured {_mb(measured)} MB")
    if fidelity_expected and result.loss_fidelity is None:
        problems.append("no fidelity")
    elif result.loss_fidelity is not None and not result.loss_fidelity <= tolerance:
        problems.append(f"fidelity {result.loss_fidelity:.1e} > {tolerance:.0e}")
    return problems


def _figure(predicted: int, risk: int = 0) -> str:
    low, high = band(predicted, risk)
    return f"{_mb(predicted)}{f' +{_mb(risk)} risk' if risk else ''} ({_mb(low)}–{_mb(high)})"


def _ledger(study: StudySpec, candidate: Candidate) -> Ledger:
    return compute_ledger(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)


def _row(label: str, ledger: Ledger, result: TrialResult | None, problems: list[str]) -> str:
    """One markdown row; ``result`` None: planned or skipped, nothing measured."""
    planned = result is None and not problems
    check = "-" if planned else "FAIL: " + "; ".join(problems) if problems else \
        "not checked (this CPU refuses fp16)" if result is not None and result.outcome is Outcome.UNSUPPORTED \
        else "pass"
    if result is None or result.outcome is not Outcome.OK:
        outcome = "planned" if planned else "skipped" if result is None else result.outcome
        note = "" if result is None else result.message[:90]
        return (f"| {label} | {outcome} | {_figure(ledger.training_bytes, ledger.risk_bytes)} | {note} "
                f"| {_figure(ledger.init_bytes)} | | | | | {check} |")
    fidelity = "-" if result.loss_fidelity is None else f"{result.loss_fidelity:.1e}"
    train, init = result.training_peak_memory_bytes, result.init_peak_memory_bytes
    return (f"| {label} | ok | {_figure(ledger.training_bytes, ledger.risk_bytes)} | {_mb(train)} / "
            f"{_mb(result.training_peak_reserved_bytes)} ({_error(ledger.training_bytes, train)}) "
            f"| {_figure(ledger.init_bytes)} | {_mb(init)} / "
            f"{_mb(result.init_peak_reserved_bytes)} ({_error(ledger.init_bytes, init)}) | "
            f"{result.tokens_per_s or 0:,.0f} | {result.skipped_steps} | {fidelity} | {check} |")


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
            "-m", "launchers.rank.hf_trainer_rank", "--ds-config", str(config_path),
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


def _prepare_ops(studies: list[StudySpec]) -> None:
    """Build or load the DeepSpeed ops the grid's candidates need (FusedAdam on CUDA) before the clock starts, as a
    study's worker does (:func:`launchers.study.op_prep.prepare_ops`); an op missing here fails its rows."""
    from launchers.study.op_prep import prepare_ops

    for study in studies:
        prepare_ops(spec=study, gpus=None, worker="gpu-check")


def _probe(study: StudySpec, *, dry: bool) -> str:
    """This machine's kernels at the first row's shapes (``dsopt probe``, measured afresh) beside the datasheet of
    the built-in profile that names the device (none on CPU ranks): what the first GPU run shows of both."""
    import torch

    from launchers.probe.machine import ProbeUnavailable, machine_probe
    from optimizer.cli.probe import table
    from optimizer.study.hardware_profiles import profile_for_device

    if not dry:
        found = profile_for_device(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)
        study = dataclasses.replace(study, hardware=dataclasses.replace(study.hardware, profile=found))
    try:
        probe = machine_probe(study, refresh=True)
    except ProbeUnavailable as err:
        return f"probe: not measured ({err})"
    return "\n".join(table(study, probe))


def _fp16_refused(result: TrialResult, knobs: dict[str, Any], *, dry: bool) -> bool:
    """An fp16 row a CPU refuses: data on CPU ranks (DeepSpeed's CPU accelerator decides), a failure on a GPU."""
    return dry and knobs.get("precision") == "fp16" and result.outcome is Outcome.UNSUPPORTED


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="2 CPU ranks, tiny shapes (no GPU needed)")
    parser.add_argument("--plan", action="store_true", help="print the rows, their figures and bands; run nothing")
    parser.add_argument("--minutes", type=float, default=7.5, help="stop launching after this long")
    parser.add_argument("--rows", type=int, default=None, help="run only the first N rows (tests)")
    parser.add_argument("--only", choices=("gpt", "llama"), default=None, help="run one model's rows")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the HF Trainer run")
    args = parser.parse_args()
    import torch

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --dry-run to check the pipeline on CPU ranks",
              file=sys.stderr)
        return 2
    gpus = 2 if dry else min(8, torch.cuda.device_count())
    device = "2 CPU ranks (dry run)" if dry else f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}"
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC · {device} · {platform.node()} · torch "
          f"{torch.__version__} · MB = 10^6 bytes · band: the ledger at most {float(UNDER):.0%} under and "
          f"{float(OVER):.0%} over "
          f"the measured allocated peak (the measured figure must fall in the brackets)\n")
    print("| model × GPUs, candidate | outcome | ledger train MB (band) | measured train MB alloc / reserved (error) | "
          "ledger init MB (band) | measured init MB alloc / reserved (error) | tokens/s | fp16 skipped | fidelity "
          "| check |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [row for row in _grid(gpus) if args.only in (None, row[0])][:args.rows]
    best: tuple[tuple[bool, float], dict[str, Any]] | None = None
    failed = 0
    with tempfile.TemporaryDirectory(prefix="dsopt-gpu-check-") as tmp:
        folder = Path(tmp)
        studies = {(model, n): _study(folder, model=model, gpus=n, dry=dry) for model, n, _ in rows}
        if not args.plan:
            _prepare_ops(list(studies.values()))
            print(_probe(studies[rows[0][0], rows[0][1]], dry=dry) + "\n", flush=True)
        started = time.monotonic()
        references: dict[tuple[str, int], list[float] | None] = {}
        for model, n, knobs in rows:
            study = studies[model, n]
            candidate = with_knobs(baseline_candidate(study.training), knobs)
            label, ledger = f"{model} ×{n} {candidate.label()}", _ledger(study, candidate)
            if args.plan:
                print(_row(label, ledger, None, []))
                continue
            if time.monotonic() - started > args.minutes * 60:
                failed += 1
                print(_row(label, ledger, None, [f"not launched: past {args.minutes} min"]))
                continue
            if (model, n) not in references:
                try:
                    references[model, n] = reference_losses(study)
                except ReferenceFailed as reference_failed:
                    print(f"FP32 reference of {model} ×{n} failed: {reference_failed}")
                    references[model, n] = None
            result = run_trial(study=study, candidate=candidate, reference_losses=references[model, n])
            problems = [] if _fp16_refused(result, knobs, dry=dry) else verdict(
                ledger=ledger, result=result, tolerance=study.trial.tolerance(Precision(knobs["precision"])))
            failed += bool(problems)
            print(_row(label, ledger, result, problems))
            sys.stdout.flush()
            if model == "llama" and n == gpus and result.outcome is Outcome.OK:
                rank = (knobs["zero_stage"] == 3, result.tokens_per_s or 0.0)  # stage 3 shows zero.Init
                if best is None or rank > best[0]:
                    best = (rank, knobs)
        if not args.skip_hf and not args.plan:
            if best is None:
                print("\nHF Trainer run: no Llama candidate measured ok, nothing to export")
            else:
                print("\n" + _hf_trainer(folder, studies["llama", gpus], best[1], dry=dry))
        if not args.plan:
            print(f"\n{len(rows) - failed} of {len(rows)} rows pass, {failed} fail · total "
                  f"{time.monotonic() - started:.0f} s after the op build")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
