"""Many workers, one study: setup exactly once, one launch per candidate at a time, a global budget.

Everything here is kept in the Optuna storage the workers share (PostgreSQL, a journal file, or SQLite for
one process) — no queue or lock service of our own. Two primitives are enough, because every storage
Optuna offers is linearizable for single attribute writes and reads:

**Setup lease** (study attribute ``dsopt_setup``): the first worker to find the study not set up for the
current study file writes a lease naming itself, waits :data:`SETTLE_S`, reads it back and proceeds only if
the lease is still its own; the others wait until ``dsopt_ready`` names the current setup key. The holder
refreshes the lease while it works; a lease not refreshed for :data:`LEASE_STALE_S` (its worker died) may be
taken over. So seeding (enqueued candidates) and the FP32 reference run happen once per study.

**Launch claims** (trial attribute ``launch_claim``): before a trial launches DeepSpeed it writes a claim
``{trial, key, worker, state: claimed}`` and then reads every trial. It withdraws (``state: withdrawn``) if
another *running* trial holds an active claim on the same candidate, or if the launches of the study —
running or finished, its own included, each trial's retries and the FP32 reference's launch counted
(:func:`launches_used`) — exceed ``budget.max_launches``. Of two workers racing, the later
writer always sees the earlier claim (write-then-read on a linearizable store), so at worst both withdraw
and retry after a random pause; never both launch. A claim counts only on the trial whose number it names,
because Optuna's retry of a stale trial copies the user attributes into the new trial.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

import optuna

from optimizer.study.cluster_settings import BudgetSettings

TrialState = optuna.trial.TrialState

CLAIM_ATTR = "launch_claim"
"""Trial attribute holding a launch claim."""
WORKER_ATTR = "worker"
"""Trial attribute naming the worker that ran the trial (``host:pid``, plus the SLURM array task)."""
LAUNCHES_ATTR = "launches"
"""Trial attribute: how many times the trial launched DeepSpeed (1 + its retries); 1 while it runs."""
REFERENCE_LAUNCHES_ATTR = "dsopt_reference_launches"
"""Study attribute: launches the FP32 reference took (0 when it came from the cache)."""
CREATED_ATTR = "dsopt_created_at"
"""Study attribute: when the study was set up (ISO 8601, UTC) — the origin of ``budget.max_hours``."""
SETTLE_S = 1.0
"""Pause between writing the setup lease and reading it back."""
LEASE_REFRESH_S = 10.0
"""How often the setup lease's holder refreshes it."""
LEASE_STALE_S = 90.0
"""A setup lease not refreshed this long belongs to a dead worker and may be taken over."""


def worker_id() -> str:
    """``host:pid``, with the SLURM array job and task when running under SLURM (``host:pid/123_4``)."""
    name = f"{socket.gethostname()}:{os.getpid()}"
    job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if job and task:
        return f"{name}/{job}_{task}"
    return f"{name}/{os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else name


def _claim(trial: optuna.trial.FrozenTrial) -> dict[str, Any] | None:
    claim = trial.user_attrs.get(CLAIM_ATTR)
    if isinstance(claim, dict) and claim.get("trial") == trial.number and claim.get("state") == "claimed":
        return claim
    return None


def active_claims(trials: Iterable[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """Trials holding an active launch claim: launched (finished) or launching now."""
    return [t for t in trials if t.state in (TrialState.RUNNING, TrialState.COMPLETE, TrialState.FAIL)
            and _claim(t) is not None]


def launches_used(trials: Iterable[optuna.trial.FrozenTrial], *, reference_launches: int = 0) -> int:
    """Real DeepSpeed launches the study has made or is making, all workers together: each claimed trial's
    launches (its retries included, :data:`LAUNCHES_ATTR`; 0 for an ``invalid`` result that started no rank;
    1 while it runs) and the FP32 reference's."""
    return sum(int(t.user_attrs.get(LAUNCHES_ATTR, 1)) for t in active_claims(trials)) + reference_launches


def budget_spent(*, trials: list[optuna.trial.FrozenTrial], budget: BudgetSettings, created_at: str | None,
                 now: datetime, reference_launches: int = 0) -> str | None:
    """Why no further launch may start (launch cap, deadline, hours since creation), or None."""
    if budget.max_launches is not None:
        used = launches_used(trials, reference_launches=reference_launches)
        if used >= budget.max_launches:
            return (f"{used} of budget.max_launches={budget.max_launches} launches used (retries and the FP32 "
                    "reference included)")
    if budget.deadline is not None and now >= budget.deadline:
        return f"budget.deadline {budget.deadline.isoformat()} has passed"
    if budget.max_hours is not None and created_at is not None:
        end = datetime.fromisoformat(created_at) + timedelta(hours=budget.max_hours)
        if now >= end:
            return f"budget.max_hours={budget.max_hours:g} since the study was created ({created_at}) have passed"
    return None


def now_utc() -> datetime:
    """The current instant, timezone-aware (UTC)."""
    return datetime.now(UTC)


class ClaimOutcome(StrEnum):
    """How a launch claim ended."""

    GRANTED = "granted"
    """This trial may launch."""
    BUSY = "busy"
    """Another running trial is launching the same candidate."""
    OVER_BUDGET = "over_budget"
    """Launching would exceed ``budget.max_launches``."""


def try_claim(*, study: optuna.Study, trial: optuna.Trial, key: str, worker: str,
              budget: BudgetSettings) -> ClaimOutcome:
    """Write a claim for ``trial`` on candidate ``key``, read every trial, keep or withdraw it (module doc)."""
    claim = {"trial": trial.number, "key": key, "worker": worker, "state": "claimed", "at": now_utc().isoformat()}
    trial.set_user_attr(CLAIM_ATTR, claim)
    claims = active_claims(study.get_trials(deepcopy=False))
    busy = any(t.number != trial.number and t.state is TrialState.RUNNING and _claim(t)["key"] == key  # type: ignore[index]
               for t in claims)
    used = launches_used(claims, reference_launches=int(study.user_attrs.get(REFERENCE_LAUNCHES_ATTR, 0)))
    over = budget.max_launches is not None and used > budget.max_launches
    if busy or over:
        trial.set_user_attr(CLAIM_ATTR, {**claim, "state": "withdrawn"})
        return ClaimOutcome.BUSY if busy else ClaimOutcome.OVER_BUDGET
    return ClaimOutcome.GRANTED


def running_elsewhere(trials: Iterable[optuna.trial.FrozenTrial], key: str, *, exclude: int) -> bool:
    """Whether another running trial holds an active claim on candidate ``key``."""
    return any(t.number != exclude and t.state is TrialState.RUNNING and _claim(t)["key"] == key  # type: ignore[index]
               for t in active_claims(trials))


@dataclass(frozen=True, kw_only=True, slots=True)
class Pause:
    """Random pauses between retries (so that two workers that collided do not collide again)."""

    low_s: float = 0.2
    high_s: float = 1.5
    sleep: Callable[[float], None] = time.sleep

    def __call__(self) -> None:
        self.sleep(random.uniform(self.low_s, self.high_s))


class SetupLease:
    """The ``dsopt_setup`` lease (module doc): who sets up the study for a given setup key."""

    def __init__(self, study: optuna.Study, *, key: str, worker: str, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.study = study
        self.key = key
        self.worker = worker
        self.clock = clock
        self.sleep = sleep

    def ready(self) -> bool:
        """Whether the study is set up for this key."""
        return self.study.user_attrs.get("dsopt_ready") == self.key

    def acquire(self) -> bool:
        """Try to take the lease: True if this worker now holds it (it must then set up and :meth:`finish`)."""
        lease = self.study.user_attrs.get("dsopt_setup")
        if isinstance(lease, dict) and lease.get("key") == self.key and lease.get("worker") != self.worker \
                and self.clock() - float(lease.get("at", 0.0)) < LEASE_STALE_S:
            return False
        self.refresh()
        self.sleep(SETTLE_S)
        lease = self.study.user_attrs.get("dsopt_setup")
        return isinstance(lease, dict) and lease.get("worker") == self.worker and lease.get("key") == self.key

    def refresh(self) -> None:
        """Write (or renew) the lease in this worker's name."""
        self.study.set_user_attr("dsopt_setup", {"key": self.key, "worker": self.worker, "at": self.clock()})

    def finish(self) -> None:
        """Mark the study set up for this key."""
        self.study.set_user_attr("dsopt_ready", self.key)

    def holder(self) -> str:
        """The worker named by the current lease (for messages)."""
        lease = self.study.user_attrs.get("dsopt_setup")
        return str(lease.get("worker")) if isinstance(lease, dict) else "nobody"
