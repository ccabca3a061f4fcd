"""A trial over its per-rank limits stops there, for real on 2 CPU ranks: CPU ranks read their live-tensor peaks
when the profiler stops at the end of the warm-up, so that is where they stop, together and cleanly, and the
result keeps what they measured until then (``launchers/rank/trial_rank.py``)."""

from __future__ import annotations

import json

import pytest
from trial_processes import trial_processes

from launchers.trial.run import rank_plan, reference_key, run_trial
from optimizer.results.trial_result import Outcome, StopAbove
from optimizer.study.specs import baseline_candidate

pytestmark = pytest.mark.slow

NEVER_BYTES = 10**15
"""A limit no cpu-tiny rank comes near (its peaks are a few MB)."""


def _reports(trial_dir):
    return [json.loads((trial_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_run_over_its_training_limit_stops_after_the_warm_up(tiny):
    candidate = baseline_candidate(tiny.training)
    warmup = tiny.trial.warmup_steps
    key = reference_key(tiny)
    full = run_trial(study=tiny, candidate=candidate, trial_dir=tiny.output_dir / "full")
    assert full.outcome is Outcome.OK and full.stopped_at is None, full.message + full.log_tail
    folder = tiny.output_dir / "stopped"
    stopped = run_trial(study=tiny, candidate=candidate, trial_dir=folder,
                        stop_above=StopAbove(training_bytes=1, init_bytes=NEVER_BYTES))
    print(f"full run: wall {full.wall_s:.1f} s, training peak {full.training_peak_memory_bytes} B; stopped run: "
          f"wall {stopped.wall_s:.1f} s, {stopped.message}")
    assert stopped.outcome is Outcome.OOM, stopped.message + stopped.log_tail
    assert stopped.stopped_at == f"step {warmup - 1}"  # the last warm-up step: where the profiler stops
    assert len(stopped.losses) == warmup < len(full.losses)
    assert stopped.losses == pytest.approx(full.losses[:warmup], rel=1e-6)  # the same run, cut short
    assert stopped.step_time_s is None and stopped.tokens_per_s is None and stopped.loss_fidelity is None
    assert all(r.step_times_s == () for r in stopped.ranks) and len(stopped.ranks) == 2
    assert all(r.training_peak_allocated_bytes > 1 and r.init_peak_allocated_bytes > 0 for r in stopped.ranks)
    assert "measured training peak" in stopped.message and "above the limit 1 bytes" in stopped.message
    for report in _reports(folder):
        assert report["status"] == "over_budget" and report["stopped_at"] == stopped.stopped_at
        assert report["over_limit"]["phase"] == "training" and report["over_limit"]["limit_bytes"] == 1
    plan = json.loads((folder / "plan.json").read_text())
    assert plan.pop("stop_above") == {"training_bytes": 1, "init_bytes": NEVER_BYTES}
    assert plan == json.loads(json.dumps(rank_plan(study=tiny, candidate=candidate)))
    assert reference_key(tiny) == key
    assert json.loads((folder / "result.json").read_text())["stopped_at"] == stopped.stopped_at
    assert trial_processes(tiny.output_dir) == []  # every rank went: none left in a collective


def test_a_run_over_its_init_limit_stops_at_init(tiny):
    folder = tiny.output_dir / "stopped"
    result = run_trial(study=tiny, candidate=baseline_candidate(tiny.training), trial_dir=folder,
                       stop_above=StopAbove(training_bytes=1, init_bytes=1))
    print(f"stopped at init: wall {result.wall_s:.1f} s, {result.message}")
    assert result.outcome is Outcome.OOM, result.message + result.log_tail
    assert result.stopped_at == "init"  # init's limit is checked first, training's too is over
    # CPU ranks learn their init peak when the profiler stops, after the warm-up: its losses were measured
    assert len(result.losses) == tiny.trial.warmup_steps and result.step_time_s is None
    assert all(r.init_peak_allocated_bytes > 1 for r in result.ranks)
    assert "measured init peak" in result.message and "above the limit 1 bytes" in result.message
    assert all(report["over_limit"]["phase"] == "init" for report in _reports(folder))
    assert trial_processes(tiny.output_dir) == []
