"""A real short trial on 2 CPU ranks reports no device readings (launchers/measure/device_memory.py): the ranks'
reports carry the ``device_*`` keys as None, and so does the result — CPU ranks have no device apart from the host."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from launchers.measure.device_memory import EMPTY
from launchers.trial.run import run_trial, trial_dir_for
from optimizer.results.device_budget import measured_device_reserve
from optimizer.results.trial_result import Outcome
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


def test_cpu_ranks_report_no_device_readings(tmp_path):
    shutil.copy(ROOT / "studies" / "cpu-tiny.yaml", tmp_path / "cpu-tiny.yaml")
    study = load_study(tmp_path / "cpu-tiny.yaml")
    candidate = baseline_candidate(study.training)
    result = run_trial(study=study, candidate=candidate)
    assert result.outcome is Outcome.OK, result.message + result.log_tail[-2000:]
    for rank in (0, 1):
        report = json.loads((trial_dir_for(study, candidate) / f"rank{rank}.json").read_text())
        assert {key: report[key] for key in EMPTY} == EMPTY
    assert result.device_memory_source is None and result.device_used_init_bytes is None
    assert result.device_used_peak_bytes is None and measured_device_reserve(result) is None
