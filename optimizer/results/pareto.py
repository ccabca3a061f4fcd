"""The measured Pareto front and picking one trial from it (Optuna holds the Pareto maths).

``study.best_trials`` is Optuna's feasible Pareto front: complete trials, constraints satisfied (loss
fidelity within tolerance), non-dominated in (peak memory ↓, tokens/s ↑). Pruned and failed trials are
never on it.

The front shows everything measured within the per-device budget; the *pick* keeps a headroom
(``budget.headroom``, :class:`~optimizer.study.cluster_settings.Headroom`) under it, so a point measured at
98 % of the budget is shown but not recommended blindly: ``fastest``, ``smallest`` and ``balanced`` choose
among front points measured ≤ budget − headroom; ``trial=N`` takes the trial named, and the caller says by
how much it is above (:func:`headroom_lines`).
"""

from __future__ import annotations

import math

import optuna

from optimizer.study.cluster_settings import Headroom
from optimizer.study.errors import UserError

PICKS = ("fastest", "smallest", "balanced")


def feasible_front(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The feasible Pareto front, smallest peak memory first; a reused trial (a copy of an earlier
    measurement of the same candidate) is shown once, as the trial that measured it."""
    unique: dict[str, optuna.trial.FrozenTrial] = {}
    for trial in sorted(study.best_trials, key=lambda t: t.number):
        unique.setdefault(trial.user_attrs.get("label", str(trial.number)), trial)
    return sorted(unique.values(), key=lambda t: (t.values[0], -t.values[1]))


def label_of(trial: optuna.trial.FrozenTrial) -> str:
    """The candidate's label (its knobs when an older trial has none)."""
    return trial.user_attrs.get("label") or " ".join(f"{k}={v}" for k, v in trial.user_attrs.get("candidate",
                                                                                                   {}).items())


def size_unit(budget_bytes: int) -> tuple[str, float, str]:
    """The unit sizes are printed in next to a budget, its bytes and the note saying so: GB (10^9 bytes) from
    1 GB up, else MB (10^6 bytes)."""
    return ("GB", 1e9, "GB = 10^9 bytes") if budget_bytes >= 1e9 else ("MB", 1e6, "MB = 10^6 bytes")


def split_by_headroom(front: list[optuna.trial.FrozenTrial], *, budget_bytes: int, headroom: Headroom,
                      ) -> tuple[list[optuna.trial.FrozenTrial], list[optuna.trial.FrozenTrial]]:
    """The front points a pick may choose (memory objective ≤ ``headroom.usable_bytes(budget_bytes)``) and
    those above that, each in the front's order."""
    usable = headroom.usable_bytes(budget_bytes)
    return [t for t in front if t.values[0] <= usable], [t for t in front if t.values[0] > usable]


def pick_trial(study: optuna.Study, how: str, *, budget_bytes: int | None = None,
               headroom: Headroom | None = None) -> optuna.trial.FrozenTrial:
    """``fastest`` (max tokens/s), ``smallest`` (min peak memory), ``balanced`` (the front point nearest the
    ideal after scaling both objectives to [0, 1]), or ``trial=N`` (any complete, feasible trial).

    With ``budget_bytes`` (``hardware.gpu_memory``) and ``headroom`` (both or neither), ``fastest``,
    ``smallest`` and ``balanced`` choose only among front points whose memory objective (bytes per device)
    is ≤ ``headroom.usable_bytes(budget_bytes)``, and none there is a :class:`UserError` naming
    ``budget.headroom``; ``trial=N`` is taken even above it (:func:`headroom_lines` warns). Neither: every
    front point (launchers/study/demo.py's pick, until it passes the study's).
    """
    if (budget_bytes is None) != (headroom is None):
        raise ValueError("pick_trial takes budget_bytes and headroom together, or neither")
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
    if budget_bytes is not None and headroom is not None:
        front = _within_or_refuse(study, front, budget_bytes=budget_bytes, headroom=headroom)
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


def _within_or_refuse(study: optuna.Study, front: list[optuna.trial.FrozenTrial], *, budget_bytes: int,
                      headroom: Headroom) -> list[optuna.trial.FrozenTrial]:
    within, _ = split_by_headroom(front, budget_bytes=budget_bytes, headroom=headroom)
    if within:
        return within
    unit, scale, note = size_unit(budget_bytes)
    smallest = min(front, key=lambda t: t.values[0])
    raise UserError(source=f"study {study.study_name}", key="budget.headroom", why=(
        f"none of the {len(front)} front point(s) measured ≤ {headroom.usable_bytes(budget_bytes) / scale:,.3f} "
        f"{unit} ({note}), the {budget_bytes / scale:,.3f} {unit} budget less "
        f"{headroom.percent} kept free ({headroom.basis}); the smallest, trial #{smallest.number} "
        f"{label_of(smallest)}, measured {smallest.values[0] / scale:,.3f} {unit} "
        f"({100 * smallest.values[0] / budget_bytes:.1f} % of the budget); lower budget.headroom (0 allowed) or "
        f"export it as measured with --pick trial={smallest.number}"))


def headroom_lines(study: optuna.Study, *, picked: optuna.trial.FrozenTrial, how: str, budget_bytes: int,
                   headroom: Headroom) -> list[str]:
    """What ``dsopt export`` prints about the headroom: the usable bytes and how many front points are within
    them, the front points left out (label, % of the budget), and a warning when ``picked`` is above the
    headroom, by how much (``trial=N``, or a pick made without the headroom: launchers/study/demo.py's today)."""
    front = feasible_front(study)
    within, above = split_by_headroom(front, budget_bytes=budget_bytes, headroom=headroom)
    unit, scale, note = size_unit(budget_bytes)
    usable = headroom.usable_bytes(budget_bytes)

    def size(n_bytes: float) -> str:
        return f"{n_bytes / scale:,.3f} {unit}"

    def share(n_bytes: float) -> str:
        return f"{100 * n_bytes / budget_bytes:.1f} % of the budget"

    named = how.startswith("trial=")
    chooses = "trial=N takes the trial named; fastest/smallest/balanced pick" if named else "picks"
    lines = [f"headroom: {headroom.percent} of the {size(budget_bytes)} budget kept free ({headroom.basis}) → "
             f"{chooses} among {len(within)} of {len(front)} front points measured ≤ {size(usable)} ({note}, per "
             "device)"]
    if above:
        lines.append(f"left out, measured above {size(usable)}: "
                     + ", ".join(f"trial #{t.number} {label_of(t)} ({share(t.values[0])})" for t in above))
    if picked.values[0] > usable:
        why = (f"exported because --pick {how} names it" if named
               else f"picked without the headroom (dsopt export --pick {how} picks within it)")
        lines.append(f"warning: trial #{picked.number} measured {size(picked.values[0])} ({share(picked.values[0])}), "
                     f"{size(picked.values[0] - usable)} ({share(picked.values[0] - usable)}) above the headroom's "
                     f"{size(usable)}; {why}")
    return lines


def front_table(study: optuna.Study, *, budget_bytes: int | None = None, headroom: Headroom | None = None) -> str:
    """The front as a table: peak memory, throughput, fidelity, the candidate's label; with ``budget_bytes`` the header
    names the per-device budget and how many launches ended over it (outcome ``oom``, never on the front); with
    ``headroom`` too, a column says whether each row is within the headroom (what the export's picks choose from)."""
    front = feasible_front(study)
    lines = [f"study {study.study_name}: feasible Pareto front, {len(front)} trial(s) (MB = 10^6 bytes)"]
    usable = None
    if budget_bytes is not None:
        ooms = sum(1 for t in study.get_trials(deepcopy=False)
                   if t.user_attrs.get("outcome") == "oom" and "reused_from" not in t.user_attrs)
        lines.append(f"  per-device budget {budget_bytes / 1e6:,.3f} MB; {ooms} launch(es) ended out of memory "
                     "or measured over it (outcome oom, not on the front)")
        if headroom is not None:
            usable = headroom.usable_bytes(budget_bytes)
            lines.append(f"  headroom {headroom.percent} kept free ({headroom.basis}): the export picks only among "
                         f"rows measured ≤ {usable / 1e6:,.3f} MB (within = yes)")
    within = f" {'within':>6}" if usable is not None else ""
    lines.append(f"  {'trial':>5} {'train MB':>10} {'tokens/s':>10} {'fidelity':>9}{within}  candidate")
    for t in front:
        fidelity = t.user_attrs.get("loss_fidelity")
        mark = "" if usable is None else f" {'yes' if t.values[0] <= usable else 'no':>6}"
        lines.append(f"  {t.number:>5} {t.values[0] / 1e6:>10.3f} {t.values[1]:>10,.0f} "
                     f"{'-' if fidelity is None else format(fidelity, '.1e'):>9}{mark}  {label_of(t)}")
    return "\n".join(lines)
