"""What a running study tells a person or a script: one line per finished trial, a status line, a JSON record
(pure: formatting only; :mod:`launchers.study.progress` prints).

A finished trial reads ``#7  z2 bf16 ckpt=full mbs=4  2.44 MB  10,099 tok/s  ✓ front`` — its number, the
candidate's label (:meth:`optimizer.study.knobs.Candidate.label`, the one identity the ledger, the launch and the
export use), the memory objective (the measured device share, MB = 10^6 bytes), throughput, and whether it is
on the feasible Pareto front now; a pruned, held, reused or failed trial says why in a few words, and a failed
launch what it cost (its wall time: ``oom: stopped at step 1: … (cost 14 s)``).
"""

from __future__ import annotations

import math
from typing import Any

import optuna
from optuna.trial import TrialState

from optimizer.search.coordination import WORKER_ATTR
from optimizer.search.ordering import candidate_of
from optimizer.study.knobs import Candidate

REASON_CHARS = 80
"""A pruned or failed trial's reason is cut to this many characters on its line (the JSON keeps it whole)."""


def trial_summary(frozen: optuna.trial.FrozenTrial, *, base: Candidate, on_front: bool) -> dict[str, Any]:
    """The facts of one finished trial, as the JSON-lines mode prints them (bytes and seconds as numbers)."""
    attrs = frozen.user_attrs
    knobs = attrs.get("candidate")
    label = candidate_of(knobs, base).label() if isinstance(knobs, dict) else str(frozen.params)
    if frozen.state is TrialState.PRUNED:
        status = "held" if attrs.get("held") else "pruned"
        reason = attrs.get("pruned_reason", "")
    elif frozen.state is TrialState.FAIL:
        status, reason = str(attrs.get("outcome", "error")), str(attrs.get("message", ""))
    elif "reused_from" in attrs:
        status, reason = "reused", f"result of trial #{attrs['reused_from']}"
    else:
        status, reason = "measured", str(attrs.get("measured_by", ""))
    values = frozen.values if frozen.state is TrialState.COMPLETE and frozen.values else None
    return {"trial": frozen.number, "status": status, "label": label, "knobs": knobs,
            "memory_bytes": int(values[0]) if values else None, "tokens_per_s": values[1] if values else None,
            "loss_fidelity": attrs.get("loss_fidelity"), "on_front": on_front, "reason": reason,
            "worker": attrs.get(WORKER_ATTR), "launches": attrs.get("launches", 0),
            "wall_s": attrs.get("wall_s") if "reused_from" not in attrs else None}


def trial_line(summary: dict[str, Any]) -> str:
    """One line for a person (module doc)."""
    head = f"#{summary['trial']:<3} {summary['label']:<34}"
    if summary["memory_bytes"] is not None:
        front = "  ✓ front" if summary["on_front"] else ""
        reused = "  (reused)" if summary["status"] == "reused" else ""
        by = f"  ({summary['reason']})" if summary["status"] == "measured" and summary["reason"] else ""
        return (f"{head} {summary['memory_bytes'] / 1e6:6.2f} MB  {summary['tokens_per_s']:>10,.0f} tok/s"
                f"{front}{reused}{by}")
    reason = " ".join(str(summary["reason"]).split()).removeprefix(f"{summary['status']}: ")
    if len(reason) > REASON_CHARS:
        reason = reason[:REASON_CHARS - 1] + "…"
    cost = f" (cost {summary['wall_s']:.0f} s)" if summary.get("wall_s") and summary["memory_bytes"] is None else ""
    return f"{head} {summary['status']}" + (f": {reason}" if reason else "") + cost


def duration_text(seconds: float | None) -> str:
    """``1h02m``, ``4m05s``, ``37s``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def status_text(*, counts: dict[str, int], ran: int, launches: int, target: int | None, now: str | None,
                best: tuple[int, float] | None, eta_s: float | None) -> str:
    """The live status line: real launches (of the target: ``--n-trials`` counts launches, retries and the FP32
    reference included), trials finished, counts by kind, the candidate running now, the fastest feasible trial
    so far and the time left (``eta_s``: None when there is no target to count down)."""
    done = (f"launches {launches}/{target} (retries, reference incl.)" if target is not None
            else f"launches {launches}") + f" · trials {ran}"
    kinds = " ".join(f"{kind} {counts[kind]}" for kind in ("measured", "reused", "pruned", "held", "failed")
                     if counts.get(kind))
    parts = [done, kinds] if kinds else [done]
    if now:
        parts.append(f"now {now}")
    parts.append(f"best #{best[0]} {best[1]:,.0f} tok/s" if best else "best none yet")
    if target is not None:
        parts.append(f"ETA {duration_text(eta_s)}")
    return " · ".join(parts)


def eta_s(*, wall_s: list[float], left: int) -> float | None:
    """Seconds left for ``left`` more launches at the mean wall time of this worker's launches so far (a launch's
    wall time holds process start, model build and DeepSpeed's init besides the steps the time model predicts)."""
    if not wall_s:
        return None
    return sum(wall_s) / len(wall_s) * max(0, left)


def counts(study: optuna.Study, *, trials: list[optuna.trial.FrozenTrial] | None = None) -> dict[str, int]:
    """Trials by kind: measured, reused, pruned (by the ledger), held (by the launch margin), failed, running."""
    trials = study.get_trials(deepcopy=False) if trials is None else trials
    complete = [t for t in trials if t.state is TrialState.COMPLETE]
    pruned = [t for t in trials if t.state is TrialState.PRUNED]
    return {
        "measured": sum(1 for t in complete if "reused_from" not in t.user_attrs),
        "reused": sum(1 for t in complete if "reused_from" in t.user_attrs),
        "pruned": sum(1 for t in pruned if not t.user_attrs.get("held")),
        "held": sum(1 for t in pruned if t.user_attrs.get("held")),
        "failed": sum(1 for t in trials if t.state is TrialState.FAIL),
        "running": sum(1 for t in trials if t.state is TrialState.RUNNING),
    }
