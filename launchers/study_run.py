"""Run a study: open the Optuna storage, seed it once, make sure the FP32 reference exists, optimise.

The glue between :mod:`optimizer.search` (pure Optuna logic) and :mod:`launchers.trial` (the launches).
Progress is one line per finished trial on stderr: trials done, pruned, failed, reused, and the best so far.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import optuna

from launchers.trial import reference_key, reference_losses, run_trial, trial_dir_for
from optimizer.knobs import Candidate
from optimizer.search import TrialFailed, branches, make_objective, open_study, seed_study
from optimizer.study_file import StudySpec
from optimizer.trial_result import TrialResult

TrialState = optuna.trial.TrialState


def default_storage(spec: StudySpec) -> str:
    """``sqlite:///<abs>/studies/<name>/study.db`` — single process only (use PostgreSQL or a journal for workers)."""
    return f"sqlite:///{(spec.output_dir / 'study.db').resolve()}"


def counts(study: optuna.Study) -> dict[str, int]:
    """Finished trials by kind: measured, reused, pruned, failed, running."""
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state is TrialState.COMPLETE]
    return {
        "measured": sum(1 for t in complete if "reused_from" not in t.user_attrs),
        "reused": sum(1 for t in complete if "reused_from" in t.user_attrs),
        "pruned": sum(1 for t in trials if t.state is TrialState.PRUNED),
        "failed": sum(1 for t in trials if t.state is TrialState.FAIL),
        "running": sum(1 for t in trials if t.state is TrialState.RUNNING),
    }


def _progress(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
    c = counts(study)
    knobs = frozen.user_attrs.get("candidate", frozen.params)
    what = frozen.state.name.lower()
    if frozen.state is TrialState.PRUNED:
        what += f" ({frozen.user_attrs.get('pruned_reason', '')[:70]})"
    elif frozen.state is TrialState.FAIL:
        what += f" ({frozen.user_attrs.get('outcome', 'error')})"
    elif frozen.values:
        what += f" {frozen.values[0] / 1e6:.2f} MB, {frozen.values[1]:,.0f} tokens/s"
    best = study.best_trials
    fastest = max(best, key=lambda t: t.values[1]) if best else None
    best_text = f"fastest feasible #{fastest.number} {fastest.values[1]:,.0f} tokens/s" if fastest else "none yet"
    print(f"[trial {frozen.number}] {what} {knobs} | measured {c['measured']} reused {c['reused']} pruned "
          f"{c['pruned']} failed {c['failed']} running {c['running']} | best: {best_text}", file=sys.stderr,
          flush=True)


def run_study(*, spec: StudySpec, storage: str, n_trials: int | None, timeout_s: float | None,
              runner: Callable[[Candidate, list[float]], TrialResult] | None = None) -> optuna.Study:
    """Create or resume the study and run up to ``n_trials`` more trials (or until ``timeout_s``)."""
    space = branches(spec)  # validate before anything is written
    if storage == default_storage(spec):
        spec.output_dir.mkdir(parents=True, exist_ok=True)  # the SQLite file's folder
    study = open_study(spec=spec, storage=storage)
    seed_study(study, spec, space)
    key = reference_key(spec)
    reference = study.user_attrs.get("reference_losses")
    if reference is None or study.user_attrs.get("reference_key") != key:  # new study, or its setup changed
        reference = reference_losses(spec)
        study.set_user_attr("reference_losses", reference)
        study.set_user_attr("reference_key", key)

    def launch(candidate: Candidate) -> TrialResult:
        if runner is not None:
            return runner(candidate, reference)
        return run_trial(study=spec, candidate=candidate, reference_losses=reference)

    objective = make_objective(spec=spec, space=space, runner=launch,
                               artifact_dir=lambda candidate: str(trial_dir_for(spec, candidate)))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=n_trials, timeout=timeout_s, catch=(TrialFailed,), callbacks=[_progress])
    return study
