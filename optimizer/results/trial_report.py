"""Render a trial result beside the ledger's prediction: a table for people, JSON for programs (pure)."""

from __future__ import annotations

from typing import Any

from optimizer.ledger.core import Ledger
from optimizer.results.trial_result import Outcome, TrialResult

MB = 10**6


def trial_json(*, result: TrialResult, ledger: Ledger | None, tolerance: float, trial_dir: str,
               study: str) -> dict[str, Any]:
    """One JSON object: the outcome, the four results, the ledger's prediction."""
    per_rank_predicted = None
    if ledger is not None:
        per_rank_predicted = (ledger.host_bytes // ledger.ranks_per_node) if ledger.device_is_host \
            else ledger.per_gpu()["total"]
    return {
        "study": study,
        "candidate": None if ledger is None else ledger.candidate.knobs(),
        "outcome": result.outcome.value,
        "message": result.message,
        "stopped_at": result.stopped_at,
        "peak_memory_bytes": result.peak_memory_bytes,
        "peak_reserved_bytes": result.peak_reserved_bytes,
        "peak_rss_bytes": result.peak_rss_bytes,
        "per_rank_peak_bytes": [r.peak_allocated_bytes for r in result.ranks],
        "init_peak_memory_bytes": result.init_peak_memory_bytes,
        "init_peak_reserved_bytes": result.init_peak_reserved_bytes,
        "predicted_init_bytes": None if ledger is None else ledger.init_bytes,
        "training_peak_memory_bytes": result.training_peak_memory_bytes,
        "training_peak_reserved_bytes": result.training_peak_reserved_bytes,
        "predicted_training_bytes": None if ledger is None else ledger.training_bytes,
        "device_name": result.device_name,
        "device_total_bytes": result.device_total_bytes,
        "gpu_capacity_bytes": None if ledger is None else ledger.gpu_capacity_bytes,
        "device_memory_source": result.device_memory_source,
        "device_used_init_bytes": result.device_used_init_bytes,
        "device_non_torch_init_bytes": result.device_non_torch_init_bytes,
        "device_used_peak_bytes": result.device_used_peak_bytes,
        "device_non_torch_peak_bytes": result.device_non_torch_peak_bytes,
        "predicted_device_reserve_bytes": None if ledger is None else ledger.device_reserve_bytes,
        "skipped_steps": result.skipped_steps,
        "applied": list(result.applied),
        "loss_scales": list(result.loss_scales),
        "construction": next((r.construction for r in result.ranks), None),
        "init_s": result.init_s,
        "gc_pause_s": result.gc_pause_s,
        "gc_full_collections": result.gc_full_collections,
        "step_time_s": result.step_time_s,
        "step_time_range_s": result.step_time_range_s,
        "measured_steps": len(result.ranks[0].step_times_s) if result.ranks else 0,
        "tokens_per_s": result.tokens_per_s,
        "losses": list(result.losses),
        "grad_norms": list(result.grad_norms),
        "loss_fidelity": result.loss_fidelity,
        "fidelity_tolerance": tolerance,
        "fidelity_ok": None if result.loss_fidelity is None else result.loss_fidelity <= tolerance,
        "predicted": None if ledger is None else ledger.per_gpu()["total"],
        "predicted_rank_bytes": per_rank_predicted,
        "predicted_fits": None if ledger is None else ledger.fits,
        "wall_s": result.wall_s,
        "trial_dir": trial_dir,
        "log_tail": result.log_tail,
    }


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / MB:.3f} MB"


def device_lines(data: dict[str, Any]) -> list[str]:
    """The device as the driver sees it (CUDA ranks; none on CPU ranks): the process's use after init and at the
    largest training reading, the part outside PyTorch's pool beside the ledger's device reserve, and the device's
    total memory beside the study's ``gpu_memory``."""
    lines = []
    if data.get("device_memory_source"):
        lines.append(f"   device used as the driver sees it ({data['device_memory_source']}; read at moments, not a "
                     f"peak): after init {_mb(data['device_used_init_bytes'])}, largest after a step "
                     f"{_mb(data['device_used_peak_bytes'])}")
        lines.append(f"   outside PyTorch's pool (CUDA context, NCCL, cuBLAS): after init "
                     f"{_mb(data['device_non_torch_init_bytes'])}, at the largest reading "
                     f"{_mb(data['device_non_torch_peak_bytes'])}; the ledger's device reserve "
                     f"{_mb(data['predicted_device_reserve_bytes'])}")
    total, stated = data.get("device_total_bytes"), data.get("gpu_capacity_bytes")
    if total is not None:
        more = stated is not None and stated > total
        lines.append(f"   device total memory {_mb(total)} ({data['device_name']}); the study's gpu_memory "
                     f"{_mb(stated)}" + (": more than the device has" if more else ""))
    return lines


def trial_table(data: dict[str, Any]) -> str:
    """The four results, with the ledger's prediction beside the measured peak."""
    lines = [f"study {data['study']} · candidate {data['candidate']}", f"outcome: {data['outcome']}"]
    if data["outcome"] != Outcome.OK.value:
        lines += [f"why: {data['message']}"]
        if data.get("stopped_at"):  # stopped over the budget: what it measured until then
            lines += [f"   measured until it stopped: init peak {_mb(data['init_peak_memory_bytes'])} (reserved "
                      f"{_mb(data['init_peak_reserved_bytes'])}), training peak "
                      f"{_mb(data['training_peak_memory_bytes'])} (reserved "
                      f"{_mb(data['training_peak_reserved_bytes'])}), {len(data['losses'])} step(s) run",
                      *device_lines(data)]
        lines += ["", "log tail:", data["log_tail"].rstrip()[-2000:], "", f"files: {data['trial_dir']}"]
        return "\n".join(lines)
    fidelity = data["loss_fidelity"]
    fid_text = "no reference" if fidelity is None else (
        f"{fidelity:.2e} (tolerance {data['fidelity_tolerance']:.0e}: {'ok' if data['fidelity_ok'] else 'EXCEEDED'})")
    lines += [
        "",
        "1. peak memory per rank (MB = 10^6 bytes)",
        f"   measured  allocated peak (max over ranks): {_mb(data['peak_memory_bytes'])}"
        f"   per rank: {', '.join(_mb(v) for v in data['per_rank_peak_bytes'])}",
        f"   measured  reserved peak: {_mb(data['peak_reserved_bytes'])}   process peak RSS: "
        f"{_mb(data['peak_rss_bytes'])}",
        f"   predicted per-GPU total: {_mb(data['predicted'])}"
        + ("" if data["predicted_rank_bytes"] == data["predicted"] else
           f"   per CPU rank incl. host items: {_mb(data['predicted_rank_bytes'])}"),
        f"   init phase (model built: {data['construction']}; + deepspeed.initialize): measured "
        f"{_mb(data['init_peak_memory_bytes'])} (reserved {_mb(data['init_peak_reserved_bytes'])}), predicted "
        f"{_mb(data['predicted_init_bytes'])}",
        f"   training alone: measured {_mb(data['training_peak_memory_bytes'])} (reserved "
        f"{_mb(data['training_peak_reserved_bytes'])}), predicted {_mb(data['predicted_training_bytes'])}",
        *device_lines(data),
        "2. speed",
        f"   step time {data['step_time_s']:.4f} s (median of {data.get('measured_steps', '')} measured steps, "
        "slowest rank" + ("" if data.get("step_time_range_s") is None else
           f"; fastest {data['step_time_range_s'][0]:.4f} s, slowest {data['step_time_range_s'][1]:.4f} s") + "); "
        f"{data['tokens_per_s']:,.0f} tokens/s; init {data['init_s'] or 0:.2f} s (construction + initialize, "
        "slowest rank)",
        *([f"   cyclic GC from the first measured step on: {data['gc_pause_s']:.3f} s, {data['gc_full_collections']}"
           " full collection(s) (the most of any rank; the warm-up's heap settled first)"]
          if data["gc_pause_s"] is not None else []),
        "3. loss and gradient sanity",
        "   losses: " + ", ".join(f"{x:.5f}" for x in data["losses"]),
        "   grad norms: " + ", ".join("-" if g is None else f"{g:.4f}" for g in data["grad_norms"]),
        *([f"   fp16 overflows: {data['skipped_steps']} step(s) skipped and replayed, not timed; loss scale "
           + ", ".join("-" if x is None else f"{x:g}" for x in data["loss_scales"])] if data["skipped_steps"] else []),
        f"4. agreement with the FP32 baseline: {fid_text}",
        "",
        f"files: {data['trial_dir']} (ds_config.json, plan.json, log.txt, result.json)",
    ]
    return "\n".join(lines)
