"""The shared-storage rules (optimizer/search/coordination.py) on a real Optuna storage, no DeepSpeed."""

from __future__ import annotations

import random
import threading
import time
from datetime import UTC, datetime, timedelta

import optuna
import pytest

from optimizer.search.coordination import (
    CLAIM_ATTR,
    ClaimOutcome,
    SetupLease,
    active_claims,
    budget_spent,
    launches_used,
    running_elsewhere,
    try_claim,
)
from optimizer.study.cluster_settings import BudgetSettings

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _study(tmp_path, name="s"):
    return optuna.create_study(study_name=name, storage=f"sqlite:///{tmp_path / 'db.sqlite'}",
                               directions=["minimize", "maximize"], load_if_exists=True)


def test_second_claim_on_a_running_candidate_is_withdrawn(tmp_path):
    study = _study(tmp_path)
    first, second, other = study.ask(), study.ask(), study.ask()
    none = BudgetSettings()
    assert try_claim(study=study, trial=first, key="A", worker="w1", budget=none) is ClaimOutcome.GRANTED
    assert try_claim(study=study, trial=second, key="A", worker="w2", budget=none) is ClaimOutcome.BUSY
    assert second.study.get_trials()[1].user_attrs[CLAIM_ATTR]["state"] == "withdrawn"
    assert try_claim(study=study, trial=other, key="B", worker="w2", budget=none) is ClaimOutcome.GRANTED
    study.tell(first, [1.0, 1.0])  # finished: the candidate is no longer running, so a new claim passes
    assert try_claim(study=study, trial=second, key="A", worker="w2", budget=none) is ClaimOutcome.GRANTED
    assert launches_used(study.get_trials()) == 3


def test_claims_over_the_cap_are_withdrawn_and_finished_launches_count(tmp_path):
    study = _study(tmp_path)
    cap = BudgetSettings(max_launches=2)
    trials = [study.ask() for _ in range(3)]
    assert try_claim(study=study, trial=trials[0], key="A", worker="w", budget=cap) is ClaimOutcome.GRANTED
    study.tell(trials[0], [1.0, 1.0])
    assert try_claim(study=study, trial=trials[1], key="B", worker="w", budget=cap) is ClaimOutcome.GRANTED
    assert try_claim(study=study, trial=trials[2], key="C", worker="w", budget=cap) is ClaimOutcome.OVER_BUDGET
    spent = budget_spent(trials=study.get_trials(), budget=cap, created_at=None, now=datetime.now(UTC))
    assert spent == "2 of budget.max_launches=2 launches used (retries and the FP32 reference included)"


def test_a_claim_copied_into_a_retried_trial_does_not_count(tmp_path):
    # RetryHeartbeatStaleTrialCallback copies user attributes into the new WAITING trial.
    study = _study(tmp_path)
    trial = study.ask()
    try_claim(study=study, trial=trial, key="A", worker="w", budget=BudgetSettings())
    copied = study.ask()
    copied.set_user_attr(CLAIM_ATTR, study.get_trials()[0].user_attrs[CLAIM_ATTR])
    assert [t.number for t in active_claims(study.get_trials())] == [trial.number]


def _race(study, keys, budget) -> list[ClaimOutcome]:
    """One thread per key; all claim at the same moment (a barrier) and, as a worker does (the module doc:
    "at worst both withdraw and retry after a random pause"), retry until the answer is final: GRANTED;
    OVER_BUDGET with the launches really used up; BUSY with another trial really running the candidate.
    Returns the final outcomes."""
    trials = [study.ask() for _ in keys]
    barrier = threading.Barrier(len(trials))
    outcomes: list[ClaimOutcome] = []

    def claim(trial, key):
        barrier.wait()
        for _ in range(200):
            if budget_spent(trials=study.get_trials(), budget=budget, created_at=None, now=datetime.now(UTC)):
                outcomes.append(ClaimOutcome.OVER_BUDGET)
                return
            outcome = try_claim(study=study, trial=trial, key=key, worker=str(trial.number), budget=budget)
            if outcome is ClaimOutcome.GRANTED or (outcome is ClaimOutcome.BUSY and running_elsewhere(
                    study.get_trials(), key, exclude=trial.number)):
                outcomes.append(outcome)
                return
            time.sleep(random.uniform(0.0, 0.05))

    threads = [threading.Thread(target=claim, args=(t, k)) for t, k in zip(trials, keys, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outcomes) == len(keys), "a claimant never got a final answer"
    return outcomes


def test_concurrent_claims_grant_exactly_the_cap(tmp_path):
    """Eight threads race for three launches on one SQLite storage; repeated to catch interleavings. Never
    more than the cap — and not fewer either: a rule that withdraws every claim would launch nothing."""
    for round_ in range(5):
        study = _study(tmp_path, name=f"race{round_}")
        outcomes = _race(study, [f"k{i}" for i in range(8)], BudgetSettings(max_launches=3))
        assert outcomes.count(ClaimOutcome.GRANTED) == 3
        assert outcomes.count(ClaimOutcome.OVER_BUDGET) == 5
        assert launches_used(study.get_trials()) == 3


def test_concurrent_claims_on_one_candidate_grant_exactly_one(tmp_path):
    for round_ in range(5):
        study = _study(tmp_path, name=f"same{round_}")
        outcomes = _race(study, ["same"] * 6, BudgetSettings())
        assert outcomes.count(ClaimOutcome.GRANTED) == 1
        assert outcomes.count(ClaimOutcome.BUSY) == 5
        assert launches_used(study.get_trials()) == 1


def test_deadline_and_hours_since_creation():
    now = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    assert budget_spent(trials=[], budget=BudgetSettings(deadline=now), created_at=None, now=now).startswith(
        "budget.deadline")
    assert budget_spent(trials=[], budget=BudgetSettings(deadline=now + timedelta(seconds=1)), created_at=None,
                        now=now) is None
    created = (now - timedelta(hours=3)).isoformat()
    assert "max_hours=2" in budget_spent(trials=[], budget=BudgetSettings(max_hours=2), created_at=created, now=now)
    assert budget_spent(trials=[], budget=BudgetSettings(max_hours=4), created_at=created, now=now) is None


def test_setup_lease_goes_to_one_worker_and_a_stale_one_is_taken_over(tmp_path):
    study = _study(tmp_path)
    clock = [1000.0]
    a = SetupLease(study, key="k", worker="a", clock=lambda: clock[0], sleep=lambda s: None)
    b = SetupLease(study, key="k", worker="b", clock=lambda: clock[0], sleep=lambda s: None)
    assert a.acquire()
    assert not b.acquire() and b.holder() == "a"
    clock[0] += 30
    assert not b.acquire()  # a is alive (lease younger than LEASE_STALE_S)
    clock[0] += 100
    assert b.acquire() and b.holder() == "b"  # a went silent: b takes over
    b.finish()
    assert a.ready() and b.ready()
    assert not SetupLease(study, key="other", worker="c").ready()  # a changed study file needs a new setup


def test_lease_write_race_leaves_one_holder(tmp_path):
    """Both write before either reads back: only the last writer proceeds."""
    study = _study(tmp_path)
    a = SetupLease(study, key="k", worker="a", sleep=lambda s: None)
    b = SetupLease(study, key="k", worker="b", sleep=lambda s: b.refresh())  # b writes during a's settle pause
    a_sleep = a.sleep
    a.sleep = lambda s: (b.refresh(), a_sleep(s))
    assert not a.acquire()
    assert b.holder() == "b"


@pytest.mark.parametrize("bad", [{"max_launches": 0}, {"max_hours": 0.0}])
def test_budget_settings_validate(bad):
    with pytest.raises(ValueError):
        BudgetSettings(**bad)
