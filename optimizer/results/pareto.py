"""The measured Pareto front and picking one trial from it (Optuna holds the Pareto maths).

``study.best_trials`` is Optuna's feasible Pareto front: complete trials, constraints satisfied (loss
fidelity within tolerance), non-dominated in (peak memory ↓, tokens/s ↑). Pruned and failed trials are
never on it.
"""

from __future__ import annotations

import math

import optuna

from optimizer.study.errors import UserError

PICKS = ("fastest", "smallest", "balanced")


def feasible_front(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The feasible Pareto front, smallest peak memory first; a reused trial (a copy of an earlier
    measurement of the same candidate) is shown once, as the trial that measured it."""
    unique: dict[str, optuna.trial.FrozenTrial] = {}
    for trial in sorted(study.best_trials, key=lambda t: t.number):
        unique.setdefault(trial.user_attrs.get("label", str(trial.number)), trial)
    return sorted(unique.values(), key=lambda t: (t.values[0], -t.values[1]))


def pick_trial(study: optuna.Study, how: str) -> optuna.trial.FrozenTrial:
    """``fastest`` (max tokens/s), ``smallest`` (min peak memory), ``balanced`` (the front point nearest the
    ideal after scaling both objectives to [0, 1]), or ``trial=N`` (any complete, feasible trial)."""
    front = feasible_front(study)
    if how.startswith("trial="):
        try:
            number = int(how.removeprefix("trial="))
        except ValueError:
            raise UserError(source="--pick", key=how, why="expected trial=N with an integer N") from None
        trials = [t for t in study.get_trials(deepcopy=False) if t.number == number]
        if not trials or trials[0].state is not optuna.trial.TrialState.COMPLETE:
            raise UserError(source="--pick", key=how, why=f"trial {number} is not a complete trial of the study")
        if any(value > 0 for value in trials[0].constraints.values()):
            raise UserError(source="--pick", key=how, why=f"trial {number} violates the loss-fidelity constraint")
        return trials[0]
    if how not in PICKS:
        raise UserError(source="--pick", key=how, why=f"expected one of {', '.join(PICKS)} or trial=N")
    if not front:
        raise UserError(source="study", key=study.study_name, why="no feasible trial yet (none complete within "
                        "the loss-fidelity tolerance); run more trials with dsopt study run")
    if how == "fastest":
        return max(front, key=lambda t: t.values[1])
    if how == "smallest":
        return min(front, key=lambda t: t.values[0])
    memories = [t.values[0] for t in front]
    speeds = [t.values[1] for t in front]

    def scaled(value: float, low: float, high: float) -> float:
        return 0.0 if high == low else (value - low) / (high - low)

    def distance(t: optuna.trial.FrozenTrial) -> float:
        m = scaled(t.values[0], min(memories), max(memories))  # 0 is best
        s = 1.0 - scaled(t.values[1], min(speeds), max(speeds))  # 0 is best
        return math.hypot(m, s)

    return min(front, key=distance)


def front_table(study: optuna.Study, *, budget_bytes: int | None = None) -> str:
    """The front as a table: peak memory, throughput, fidelity, the candidate's label; with ``budget_bytes`` the header
    names the per-device budget and how many launches ended over it (outcome ``oom``, never on the front)."""
    front = feasible_front(study)
    lines = [f"study {study.study_name}: feasible Pareto front, {len(front)} trial(s) (MB = 10^6 bytes)"]
    if budget_bytes is not None:
        ooms = sum(1 for t in study.get_trials(deepcopy=False)
                   if t.user_attrs.get("outcome") == "oom" and "reused_from" not in t.user_attrs)
        lines.append(f"  per-device budget {budget_bytes / 1e6:,.3f} MB; {ooms} launch(es) ended out of memory "
                     "or measured over it (outcome oom, not on the front)")
    lines.append(f"  {'trial':>5} {'train MB':>10} {'tokens/s':>10} {'fidelity':>9}  candidate")
    for t in front:
        label = t.user_attrs.get("label") or " ".join(f"{k}={v}" for k, v in t.user_attrs.get("candidate", {}).items())
        fidelity = t.user_attrs.get("loss_fidelity")
        lines.append(f"  {t.number:>5} {t.values[0] / 1e6:>10.3f} {t.values[1]:>10,.0f} "
                     f"{'-' if fidelity is None else format(fidelity, '.1e'):>9}  {label}")
    return "\n".join(lines)
