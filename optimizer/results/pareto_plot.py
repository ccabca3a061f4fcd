"""Draw the study: measured trials, the feasible Pareto front highlighted and labelled with trial numbers,
the per-device budget as a vertical line, the candidates the ledger pruned at their predicted peak (not
launched, so no throughput: drawn on the zero line), and the candidates that may fit but were never tried at
their predicted need and speed (on the zero line where the time model cannot predict them). Drawing only."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import optuna

from optimizer.results.pareto import feasible_front

TrialState = optuna.trial.TrialState
MB = 1e6


Point = tuple[float, float, str]
"""(memory in MB = 10^6 bytes, tokens/s, hover label)."""


def _groups(study: optuna.Study, untried: Sequence[Point] = ()) -> dict[str, list[Point]]:
    front_numbers = {t.number for t in feasible_front(study)}
    groups: dict[str, list[Point]] = {"front": [], "feasible": [], "infeasible": [], "pruned": [], "held": [],
                                      "failed": [], "untried": list(untried)}
    for t in study.get_trials(deepcopy=False):
        label = f"#{t.number} " + " ".join(f"{k}={v}" for k, v in t.user_attrs.get("candidate", {}).items())
        if t.state is TrialState.COMPLETE and t.values:
            feasible = all(v <= 0 for v in t.constraints.values())
            kind = "front" if t.number in front_numbers else ("feasible" if feasible else "infeasible")
            groups[kind].append((t.values[0] / MB, t.values[1], label))
        elif t.state is TrialState.PRUNED and "predicted_bytes" in t.user_attrs:
            groups["held" if t.user_attrs.get("held") else "pruned"].append(
                (t.user_attrs["predicted_bytes"] / MB, 0.0, label + " — " + t.user_attrs.get("pruned_reason", "")))
        elif t.state is TrialState.FAIL and "predicted_bytes" in t.user_attrs:
            measured = t.user_attrs.get("device_share_bytes")  # a run measured over the budget: where it was
            groups["failed"].append(((measured or t.user_attrs["predicted_bytes"]) / MB, 0.0,
                                     label + f" — {t.user_attrs.get('outcome', 'failed')}"
                                     + (" (measured)" if measured else " (at its predicted peak)")))
    return groups


STYLE = {
    "front": dict(color="tab:red", marker="o", label="Pareto front (feasible)"),
    "feasible": dict(color="tab:blue", marker="o", label="measured, feasible"),
    "infeasible": dict(color="tab:gray", marker="s", label="measured, loss fidelity out of tolerance"),
    "pruned": dict(color="tab:olive", marker="x", label="pruned by the ledger (at predicted peak; not launched)"),
    "held": dict(color="tab:purple", marker="+", label="held: a risky proposal of the sampler (at predicted peak; "
                 "not launched then)"),
    "failed": dict(color="black", marker="v", label="failed: measured over the budget where measured, else at "
                   "predicted peak"),
    "untried": dict(color="tab:orange", marker="d", label="untried, may fit (at predicted need and speed)"),
}


def budget_label(budget_bytes: int) -> str:
    return f"per-device budget {budget_bytes / MB:,.3f} MB"


def write_png(study: optuna.Study, path: Path, *, budget_bytes: int, untried: Sequence[Point] = ()) -> Path:
    """``pareto.png`` with matplotlib (Agg backend); ``budget_bytes`` is the per-device budget the ledger used,
    ``untried`` the candidates that may fit and were never tried."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(study, untried)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for kind, points in groups.items():
        if points:
            style = STYLE[kind]
            ax.scatter([p[0] for p in points], [p[1] for p in points], c=style["color"], marker=style["marker"],
                       label=f"{style['label']} ({len(points)})", s=60 if kind == "front" else 30, zorder=3)
    front = sorted(groups["front"])
    if front:
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="tab:red", alpha=0.5)
        for memory, speed, label in front:
            ax.annotate(label.split(" ", 1)[0], (memory, speed), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color="tab:red")
    ax.axvline(budget_bytes / MB, color="black", linestyle="--", linewidth=1, label=budget_label(budget_bytes))
    ax.set_xlabel("training memory per device, measured: reserved peak + reserve; CPU ranks: live tensors less "
                  "host items (MB = 10^6 bytes)", fontsize=8)
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title(f"dsopt study {study.study_name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_html(study: optuna.Study, path: Path, *, budget_bytes: int, untried: Sequence[Point] = ()) -> Path:
    """``pareto.html``: Optuna's ``plot_pareto_front`` (infeasible trials coloured from the constraints), plus
    the pruned, failed and untried candidates."""
    import plotly.graph_objects as go
    from optuna.visualization import plot_pareto_front

    complete = [t for t in study.get_trials(deepcopy=False) if t.state is TrialState.COMPLETE]
    names = ["training memory per device (bytes)", "tokens/s"]
    fig = plot_pareto_front(study, target_names=names) if complete else go.Figure()
    groups = _groups(study, untried)
    for kind, symbol in (("pruned", "x"), ("held", "cross"), ("failed", "triangle-down"), ("untried", "diamond")):
        points = groups[kind]
        if points:
            fig.add_trace(go.Scatter(x=[p[0] * MB for p in points], y=[p[1] for p in points], mode="markers",
                                     name=STYLE[kind]["label"], text=[p[2] for p in points],
                                     marker=dict(symbol=symbol, size=9)))
    fig.add_vline(x=budget_bytes, line_dash="dash", line_color="black", annotation_text=budget_label(budget_bytes))
    fig.update_layout(title=f"dsopt study {study.study_name}", xaxis_title="training memory per device (bytes)",
                      yaxis_title="tokens/s")
    fig.write_html(str(path), include_plotlyjs=True)
    return path
