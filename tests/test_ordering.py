"""Ordering and calibrated pruning (optimizer/ordering.py, optimizer/search.next_candidate) on synthetic trials."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from optimizer.ledger import evaluate
from optimizer.ordering import calibrated_verdict_fits, memory_group, predicted_speed, study_models
from optimizer.search import branches, candidate_key, next_candidate, promise
from optimizer.specs import baseline_candidate
from optimizer.study_file import load_study
from optimizer.throughput import StepTime

ROOT = Path(__file__).resolve().parents[1]


def _verdicts(spec):
    return [v for v in (evaluate(candidate=c, model=spec.model, hardware=spec.hardware, training=spec.training)
                        for c in spec.search_space.candidates(baseline_candidate(spec.training)))
            if v.ledger is not None]


def _measured(spec, verdict, *, number, peak, step_time_s, state=optuna.trial.TrialState.COMPLETE):
    ledger = verdict.ledger
    return optuna.trial.create_trial(
        state=state, values=[float(peak), 1000.0] if state is optuna.trial.TrialState.COMPLETE else None,
        user_attrs={"candidate": verdict.candidate.knobs(), "candidate_key": candidate_key(verdict.candidate),
                    "peak_memory_bytes": peak, "predicted_host_bytes": 0, "step_time_s": step_time_s,
                    "predicted_gpu_needed_bytes": ledger.gpu_needed_bytes, "loss_fidelity": 0.0,
                    "tokens_per_s": 1000.0})


@pytest.fixture(scope="module")
def grid():
    return load_study(ROOT / "studies" / "grid-cpu.yaml")


def test_without_figures_the_order_is_the_promise_order(grid):
    verdicts = _verdicts(grid)
    models = study_models(spec=grid, trials=[], base=baseline_candidate(grid.training))
    choice = next_candidate(spec=grid, space=branches(grid), trials=[], models=models, verdicts=verdicts)
    fitting = sorted((v for v in verdicts if v.fits), key=promise)
    assert choice == fitting[0].candidate


def test_with_a_profile_the_order_is_predicted_throughput():
    spec = load_study(ROOT / "studies" / "llama-7b-8xh100.yaml")
    verdicts = [v for v in _verdicts(spec) if v.fits]
    models = study_models(spec=spec, trials=[], base=baseline_candidate(spec.training))
    choice = next_candidate(spec=spec, space=branches(spec), trials=[], models=models, verdicts=verdicts)
    speeds = {v.candidate: predicted_speed(v.candidate, spec=spec, models=models) for v in verdicts}
    known = {c: s.tokens_per_s for c, s in speeds.items() if isinstance(s, StepTime)}
    assert known[choice] == max(known.values())


def test_measured_running_and_queued_candidates_are_skipped(grid):
    verdicts = _verdicts(grid)
    space = branches(grid)
    base = baseline_candidate(grid.training)
    models = study_models(spec=grid, trials=[], base=base)
    first = next_candidate(spec=grid, space=space, trials=[], models=models, verdicts=verdicts)
    done = _measured(grid, next(v for v in verdicts if v.candidate == first), number=0, peak=1, step_time_s=0.1)
    second = next_candidate(spec=grid, space=space, trials=[done], models=models, verdicts=verdicts)
    assert second != first
    running = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING,
                                        user_attrs={"candidate_key": candidate_key(second)})
    third = next_candidate(spec=grid, space=space, trials=[done, running], models=models, verdicts=verdicts)
    assert third not in (first, second)


def test_calibrated_memory_never_prunes_a_measured_fit(grid):
    verdicts = _verdicts(grid)
    base = baseline_candidate(grid.training)
    budget = grid.hardware.gpu_memory_bytes
    fitting = [v for v in verdicts if v.fits]
    # Measurements 40 % above the ledger in one group, except one that fits with little room: the group's
    # factor is capped by it; other groups keep the ledger's figure.
    tight = max(fitting, key=lambda v: v.ledger.gpu_needed_bytes)
    group = memory_group(tight.candidate)
    same = [v for v in fitting if memory_group(v.candidate) == group and v is not tight][:3]
    trials = [_measured(grid, v, number=i, peak=int(v.ledger.gpu_needed_bytes * 1.4), step_time_s=0.1)
              for i, v in enumerate(same)]
    trials.append(_measured(grid, tight, number=9, peak=budget, step_time_s=0.1))
    models = study_models(spec=grid, trials=trials, base=base)
    assert models.memory_factor(tight.candidate) <= budget / tight.ledger.gpu_needed_bytes + 1e-12
    assert models.memory_factor(tight.candidate) > 1.0
    other = next(v for v in fitting if memory_group(v.candidate) != group)
    assert models.memory_factor(other.candidate) == 1.0
    assert candidate_key(tight.candidate) in models.measured_fits
    assert calibrated_verdict_fits(tight, models=models, key=candidate_key(tight.candidate), budget_bytes=budget)
    bigger = replace(models, memory_factors=((group, 10.0),))
    assert calibrated_verdict_fits(tight, models=bigger, key=candidate_key(tight.candidate), budget_bytes=budget)
    assert not calibrated_verdict_fits(same[0], models=bigger, key=candidate_key(same[0].candidate),
                                       budget_bytes=budget)


def test_time_calibration_kicks_in_after_three_measurements(grid):
    verdicts = [v for v in _verdicts(grid) if v.fits]
    base = baseline_candidate(grid.training)
    trials = [_measured(grid, v, number=i, peak=1, step_time_s=0.05 * (1 + int(v.candidate.zero_stage)))
              for i, v in enumerate(verdicts[:3])]
    assert study_models(spec=grid, trials=trials[:2], base=base).rates.source == "no hardware.profile"
    models = study_models(spec=grid, trials=trials, base=base)
    assert models.rates.source == "calibrated on 3 trial(s)"
    assert isinstance(predicted_speed(verdicts[0].candidate, spec=grid, models=models), StepTime)
