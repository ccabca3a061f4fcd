"""The device's measured figures, kept on the Optuna study (study user attributes) for every worker to plan with.

A trial measures the device reserve (memory outside PyTorch's allocator) and the device's capacity
(:mod:`optimizer.results.device_budget`); the study keeps them in :data:`RESERVE_ATTR` and :data:`CAPACITY_ATTR`, so
that a worker that joins later, or a study run again, plans with them (:func:`study_planning_spec`). The FP32
reference is the study's first launch: :func:`record_result_json` takes its figures from its ``result.json``.

The first measured reserve stays: later trials do not move it, so the plan — and the memory objective, which adds the
reserve to each trial's reserved peak — is the same for every trial after it. Two workers that finish their first
trials together may both write; the last write stays, and both are measurements of the same device type. The
capacity kept is the smallest any trial reported (the safe side, were the devices to differ).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna

from optimizer.results.device_budget import measured_device_reserve, planning_spec
from optimizer.results.trial_result import DEVICE_MEMORY_FIELDS, Outcome, RankMeasurement, TrialResult
from optimizer.study.study_file import StudySpec

RESERVE_ATTR = "measured_device_reserve_bytes"
"""Study user attribute: the device reserve the study's first measuring trial found (bytes)."""
CAPACITY_ATTR = "measured_device_total_bytes"
"""Study user attribute: the smallest ``total_memory`` a trial's devices reported (bytes)."""


def measured_reserve(study: optuna.Study) -> int | None:
    """The device reserve kept on the study (bytes), or None: no trial has measured it yet."""
    value = study.user_attrs.get(RESERVE_ATTR)
    return None if value is None else int(value)


def measured_capacity(study: optuna.Study) -> int | None:
    """The device capacity kept on the study (bytes), or None: no trial has reported its device."""
    value = study.user_attrs.get(CAPACITY_ATTR)
    return None if value is None else int(value)


def record_result_json(study: optuna.Study, data: Mapping[str, Any]) -> None:
    """Record what a trial's ``result.json`` (``launchers.trial.run.result_json``) says of the device — the FP32
    reference's (``studies/NAME/reference/result.json``), which runs before any search trial, so that the first
    trial already plans with it. Only the device's figures are read."""
    ranks = tuple(RankMeasurement(rank=int(rank["rank"]), peak_allocated_bytes=None, peak_reserved_bytes=None,
                                  peak_rss_bytes=0, step_times_s=(),
                                  **{name: rank.get(name) for name in DEVICE_MEMORY_FIELDS})
                  for rank in data.get("ranks", ()))
    result = TrialResult(outcome=Outcome(data["outcome"]), ranks=ranks,
                         device_total_bytes=data.get("device_total_bytes"))
    record_device(study, result)


def record_device(study: optuna.Study, result: TrialResult) -> tuple[int | None, int | None]:
    """Keep what ``result`` measured of the device on the study, its attributes read once (one storage read per
    launch): the reserve unless one is kept already (the first stays, so the plan does not move), the capacity
    (``device_total_bytes``) where it is the smallest yet. Returns the (reserve, capacity) kept after the call;
    None where nothing is measured yet (CPU ranks never report a device)."""
    attrs = study.user_attrs
    reserve, capacity = attrs.get(RESERVE_ATTR), attrs.get(CAPACITY_ATTR)
    if reserve is None:
        reserve = measured_device_reserve(result)
        if reserve is not None:
            study.set_user_attr(RESERVE_ATTR, reserve)
    total = result.device_total_bytes
    if total is not None and (capacity is None or total < capacity):
        capacity = int(total)
        study.set_user_attr(CAPACITY_ATTR, capacity)
    return (None if reserve is None else int(reserve), None if capacity is None else int(capacity))


def study_planning_spec(spec: StudySpec, study: optuna.Study) -> StudySpec:
    """``spec`` with what the study has measured applied (:func:`optimizer.results.device_budget.planning_spec`)."""
    return planning_spec(spec, measured_reserve_bytes=measured_reserve(study),
                         measured_total_bytes=measured_capacity(study))
