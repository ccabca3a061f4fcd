"""Record a full grid of real measurements: every valid candidate of a study, launched once.

    python benchmarks/record_grid.py [STUDY.yaml] [--out benchmarks/data/grid-cpu.json] [--probe-again]
    python benchmarks/record_grid.py STUDY.yaml --out GRID.json --fidelity-again   # the fidelity column only

Default: studies/grid-cpu.yaml — the built-in tiny GPT on 2 CPU ranks, 84 valid candidates. Every valid
candidate is launched regardless of what the ledger says (that is the point: the replay needs to know what
a pruned candidate would have measured). The file is rewritten after every trial, so an interrupted
recording resumes where it stopped. It holds the machine, the versions, the command and the study file's
hash beside the measurements, and first of all the probe of the machine's kernels at the study's shapes
(``dsopt probe``, :mod:`launchers.probe.machine`, measured afresh: the replay's time model uses the figures of the
machine the grid was recorded on). Prints one line per candidate; asserts nothing.

For each candidate it stores the measured per-rank peak (CPU ranks: the live-tensor peak, which on one
host memory includes the optimizer states DeepSpeed offloads to the host), the ledger's device and host
shares of the prediction, throughput, step time and loss fidelity. The replay (search_efficiency.py)
compares the *device* share with the per-rank budget: measured peak − the ledger's host items, which are
DeepSpeed's own offload buffers (checked byte for byte in tests/real/deepspeed/test_model_states_real.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from launchers.probe.machine import cpu_model, machine_probe
from launchers.trace.inventory import adapted_inventory
from launchers.trace.study_traces import with_traced_activations
from launchers.trial.reference_batches import judge_for, kept_as_reference, losses_for
from launchers.trial.run import check_devices, keep_reference, reference_losses, run_trial, trial_dir_for
from optimizer.ledger.core import evaluate
from optimizer.results.trial_result import loss_fidelity
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import StudySpec, load_study

ROOT = Path(__file__).resolve().parents[1]


KERNEL_PINS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
"""Environment variables that pin the CPU kernels torch and oneDNN choose (e.g. ``avx2`` on an AMX machine, whose
oneDNN bf16 matmul holds a transient no GPU kernel has: docs/benchmarks.md, "QLoRA, measured"); recorded where set."""


def machine() -> dict[str, object]:
    """What the grid was measured on (and the CPU kernels it was pinned to, where it was)."""
    cpu = cpu_model()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    pinned = {name: os.environ[name] for name in KERNEL_PINS if name in os.environ}
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": memory, "os": platform.platform(),
            "python": platform.python_version(),
            "versions": {name: metadata.version(name) for name in ("torch", "deepspeed", "optuna", "dsopt")},
            **({"kernels_pinned": pinned} if pinned else {})}


def write(out: Path, data: dict[str, object]) -> None:
    """The grid file, replaced whole (a reader never sees half of it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(out)


def judge_again(study: StudySpec, data: dict[str, Any], out: Path, reference: list[float]) -> int:
    """Every recorded candidate's loss fidelity again, from the losses its trial folder kept, against the reference
    a study judges it by now (:func:`launchers.trial.reference_batches.judge_for`); the measurements stay."""
    base = baseline_candidate(study.training)
    for entry in data["candidates"]:
        if entry["outcome"] != "ok":
            continue
        candidate = with_knobs(base, entry["knobs"])
        kept = trial_dir_for(study, candidate) / "result.json"
        result = json.loads(kept.read_text()) if kept.is_file() else {}
        losses = result.get("losses")
        if not losses or result.get("tokens_per_s") != entry["tokens_per_s"]:  # not kept, or another run's
            print(f"{kept}: no losses of the run recorded for {entry['label']}; record the grid again",
                  file=sys.stderr)
            return 2
        judge = judge_for(study, candidate)
        if judge.own:  # the reference of its micro-batch: its kept losses are that reference, not launched again
            keep_reference(judge.study, name=judge.name, candidate=candidate, losses=losses,
                           drew=bool(result.get("draws_random")))
        judged_by = losses if judge.own else losses_for(judge, reference, say=lambda text: print(text, flush=True))
        fidelity = loss_fidelity(losses, judged_by) if judged_by else None
        print(f"{entry['label']}: {entry['loss_fidelity']} -> {fidelity}", flush=True)
        entry["loss_fidelity"] = fidelity
    data["fidelity_judged"] = {"command": " ".join(["python", *sys.argv]), "at": datetime.now(UTC).isoformat(),
                               "rule": "against the FP32 reference of the candidate's own micro-batch size where "
                                       "the model draws dropout masks (launchers/trial/reference_batches.py)"}
    write(out, data)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", nargs="?", default=str(ROOT / "studies" / "grid-cpu.yaml"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "data" / "grid-cpu.json"))
    parser.add_argument("--probe-again", action="store_true", help="replace the grid's probe with one taken now "
                        "(on the machine that recorded it: the probe says when it was measured)")
    parser.add_argument("--fidelity-again", action="store_true", help="judge every recorded candidate's losses (its "
                        "trial folder's result.json) against the FP32 reference of its own micro-batch size where "
                        "the model draws dropout masks (launchers/trial/reference_batches.py); launches only those "
                        "references")
    args = parser.parse_args()
    # a study asking for traced activations gets them; one that trains in part, its inventory
    study = with_traced_activations(adapted_inventory(load_study(args.study)))
    check_devices(study)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else None
    study_hash = hashlib.sha256(Path(args.study).read_bytes()).hexdigest()
    if data is None or data.get("study_sha256") != study_hash:
        data = {"study": study.name, "study_file": os.path.relpath(study.path, ROOT), "study_sha256": study_hash,
                "command": " ".join(["python", *sys.argv]), "started": datetime.now(UTC).isoformat(),
                "machine": machine(), "budget_bytes_per_rank": study.hardware.gpu_memory_bytes, "candidates": []}
    if "probe" not in data or args.probe_again:  # first: the machine's kernels, before the grid's launches load it
        data["probe"] = machine_probe(study, refresh=True, say=lambda text: print(text, flush=True)).to_json()
        write(out, data)
    done = {entry["label"] for entry in data["candidates"]}
    reference = reference_losses(study)
    if args.fidelity_again:
        return judge_again(study, data, out, reference)
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}
    candidates = [c for c in study.search_space.candidates(baseline_candidate(study.training))
                  if evaluate(candidate=c, **spec).ledger is not None]
    print(f"{len(candidates)} valid candidates, {len(done)} already recorded in {out}", flush=True)
    for candidate in candidates:
        if candidate.label() in done:
            continue
        verdict = evaluate(candidate=candidate, **spec)
        ledger = verdict.ledger
        assert ledger is not None
        device = ledger.per_gpu()["total"]
        per_rank = ledger.host_bytes // ledger.ranks_per_node if ledger.device_is_host else device
        judge = judge_for(study, candidate)  # where dropout draws: its micro-batch's reference, launched first or it
        judged_by = None if judge.own else losses_for(judge, reference)
        start = time.monotonic()
        result = kept_as_reference(judge, candidate, run_trial(study=study, candidate=candidate,
                                                               reference_losses=judged_by))
        entry = {
            "label": candidate.label(), "knobs": candidate.knobs(), "outcome": result.outcome.value,
            "measured_peak_bytes": result.peak_memory_bytes, "training_peak_bytes": result.training_peak_memory_bytes,
            "init_peak_bytes": result.init_peak_memory_bytes, "predicted_device_bytes": device,
            "predicted_host_bytes": per_rank - device, "predicted_needed_bytes": ledger.gpu_needed_bytes,
            "ledger_fits": verdict.fits, "tokens_per_s": result.tokens_per_s, "step_time_s": result.step_time_s,
            "step_time_range_s": result.step_time_range_s,
            "loss_fidelity": result.loss_fidelity, "wall_s": round(time.monotonic() - start, 2),
        }
        data["candidates"].append(entry)
        data["finished"] = datetime.now(UTC).isoformat()
        write(out, data)
        peak = (result.peak_memory_bytes or 0) / 1e6
        speed = f"{result.tokens_per_s:,.0f}" if result.tokens_per_s else "-"
        print(f"[{len(data['candidates'])}/{len(candidates)}] {candidate.label()}: {result.outcome.value}, "
              f"peak {peak:.3f} MB, {speed} tokens/s, {entry['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
