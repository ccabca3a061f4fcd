"""A trial stopped over its budget (:class:`~optimizer.results.trial_result.StopAbove`), without ranks: the limits
as the plan carries them, the ranks' ``over_budget`` reports summarized into an ``oom`` that keeps what was
measured, where that stands beside other failures, and what ``run_trial`` writes for it."""

from __future__ import annotations

import json

import pytest
from test_trial_files import _fake_launch, _tiny_study
from trial_fixtures import NEAR, rank_report

from launchers.rank.trial_rank import _over_limit
from optimizer.ledger.items import Location
from optimizer.results.trial_report import trial_json, trial_table
from optimizer.results.trial_result import Outcome, StopAbove, stop_order, summarize

LIMIT = StopAbove(training_bytes=50, init_bytes=1000)


def _stopped(rank, *, stopped_at, over=None, **extra):
    """A rank's report as trial_rank writes it when the ranks stopped over the budget."""
    return rank_report(rank, status="over_budget", stopped_at=stopped_at, over_limit=over, **extra)


def _over(phase, peak, limit):
    return {"phase": phase, "peak_bytes": peak, "limit_bytes": limit}


def _summarize(reports, *, returncode=0, timed_out=False, world_size=2, host=None):
    return summarize(rank_reports=reports, world_size=world_size, returncode=returncode, timed_out=timed_out,
                     tokens_per_step=1000, reference_losses=[2.0, 1.5, 1.1, 1.0, 0.9], log_tail="tail", wall_s=2.5,
                     host_memory=host)


def test_stop_above_travels_in_the_plan_and_refuses_nonsense():
    assert StopAbove.from_plan(json.loads(json.dumps(LIMIT.to_plan()))) == LIMIT
    assert LIMIT.to_plan() == {"training_bytes": 50, "init_bytes": 1000}
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match=r"StopAbove\.training_bytes"):
            StopAbove(training_bytes=bad, init_bytes=1)


def test_a_rank_goes_over_only_above_its_limit_and_init_first():
    assert _over_limit(LIMIT, init_peak=1000, training_peak=50) is None  # equal goes on
    assert _over_limit(LIMIT, init_peak=None, training_peak=51) == _over("training", 51, 50)
    assert _over_limit(LIMIT, init_peak=1001, training_peak=51) == _over("init", 1001, 1000)


def test_stop_points_order_init_before_steps_numerically():
    assert sorted(["step 10", "init", "step 2", "step 0"], key=stop_order) == ["init", "step 0", "step 2", "step 10"]


def test_a_stop_in_the_warm_up_keeps_what_was_measured_without_a_step_time():
    reports = {r: _stopped(r, stopped_at="step 1", losses=[2.0, 1.5], grad_norms=[1.0, 0.9], step_times_s=[],
                           training_peak_allocated_bytes=90 + r, init_peak_allocated_bytes=40,
                           over=_over("training", 90 + r, 50)) for r in (0, 1)}
    result = _summarize(reports)
    assert result.outcome is Outcome.OOM and result.stopped_at == "step 1"
    assert result.losses == (2.0, 1.5) and result.grad_norms == (1.0, 0.9)
    assert result.step_time_s is None and result.tokens_per_s is None
    assert result.loss_fidelity is None  # not judged: the run did not end
    assert [r.rank for r in result.ranks] == [0, 1]
    assert result.training_peak_memory_bytes == 91 and result.init_peak_memory_bytes == 40
    assert result.peak_memory_bytes == 101  # rank_report's whole-run peaks: 100 + rank
    assert result.message == "stopped at step 1: measured training peak 90 bytes above the limit 50 bytes (rank 0)"
    assert result.log_tail == "tail" and result.wall_s == 2.5


def test_a_stop_among_the_measured_steps_times_the_steps_it_ran():
    reports = {0: _stopped(0, stopped_at="step 3", step_times_s=[0.2, 0.4], over=None),
               1: _stopped(1, stopped_at="step 3", step_times_s=[0.3, 0.1], over=_over("training", 70, 50))}
    result = _summarize(reports)
    assert result.step_time_s == pytest.approx(0.35)  # median of the per-step slowest rank: 0.3, 0.4
    assert result.tokens_per_s == pytest.approx(1000 / 0.35)
    assert result.message.endswith("above the limit 50 bytes (rank 1)")  # rank 0 only stopped with it


def test_a_stop_at_init_has_no_training_measurements():
    reports = {r: _stopped(r, stopped_at="init", losses=[], grad_norms=[], step_times_s=[],
                           init_peak_reserved_bytes=2000 + r, training_peak_reserved_bytes=None,
                           over=_over("init", 2000 + r, 1000)) for r in (0, 1)}
    result = _summarize(reports)
    assert result.outcome is Outcome.OOM and result.stopped_at == "init" and result.losses == ()
    assert result.step_time_s is None and result.training_peak_reserved_bytes is None
    assert result.init_peak_reserved_bytes == 2001
    assert result.message == "stopped at init: measured init peak 2000 bytes above the limit 1000 bytes (rank 0)"


def test_the_earliest_stop_and_the_rank_over_in_its_phase_speak():
    reports = {0: _stopped(0, stopped_at="step 10", over=_over("training", 60, 50)),
               1: _stopped(1, stopped_at="step 2", over=_over("training", 80, 50))}
    assert _summarize(reports).stopped_at == "step 2"
    init = {0: _stopped(0, stopped_at="init", over=_over("training", 60, 50)),
            1: _stopped(1, stopped_at="init", over=_over("init", 3000, 1000))}
    assert "init peak 3000 bytes" in _summarize(init).message and "(rank 1)" in _summarize(init).message
    silent = {r: _stopped(r, stopped_at="step 0") for r in (0, 1)}
    assert _summarize(silent).message == "stopped at step 0: no rank says which peak went over its limit"


def test_any_other_failure_beside_a_stop_wins():
    stopped = _stopped(0, stopped_at="step 1", over=_over("training", 90, 50))
    crash = {"rank": 1, "status": "crash", "error_type": "DistBackendError", "message": "peer closed"}
    oom = {"rank": 1, "status": "oom", "error_type": "OutOfMemoryError", "message": "CUDA out of memory"}
    assert _summarize({0: stopped, 1: crash}, returncode=1).outcome is Outcome.CRASH
    real = _summarize({0: stopped, 1: oom}, returncode=1)
    assert real.outcome is Outcome.OOM and real.stopped_at is None and "CUDA out of memory" in real.message
    assert _summarize({0: stopped}, returncode=1).outcome is Outcome.CRASH  # a rank lost without a word
    assert _summarize({0: stopped}, returncode=-9, host=NEAR).outcome is Outcome.OOM_HOST
    both = {r: _stopped(r, stopped_at="step 1", over=_over("training", 90, 50)) for r in (0, 1)}
    assert _summarize(both, timed_out=True, returncode=None).outcome is Outcome.TIMEOUT
    assert _summarize(both, returncode=1).outcome is Outcome.CRASH  # the teardown failed after the stop
    assert _summarize({0: stopped, 1: rank_report(1)}).outcome is Outcome.OOM  # ok beside a stop: still stopped


def test_run_trial_writes_the_limits_into_the_plan_only(repo_root, tmp_path, monkeypatch):
    import launchers.trial.run as trial
    from optimizer.study.specs import baseline_candidate

    study = _tiny_study(repo_root, tmp_path)
    candidate = baseline_candidate(study.training)
    key = trial.reference_key(study)
    reports = {r: _stopped(r, stopped_at="step 1", losses=[2.0, 1.5], step_times_s=[],
                           over=_over("training", 90, 50)) for r in (0, 1)}
    _fake_launch(monkeypatch, reports=reports, returncode=0)
    result = trial.run_trial(study=study, candidate=candidate, trial_dir=tmp_path / "t", stop_above=LIMIT)
    assert result.outcome is Outcome.OOM and result.stopped_at == "step 1" and result.log_tail
    plan = json.loads((tmp_path / "t" / "plan.json").read_text())
    assert plan.pop("stop_above") == LIMIT.to_plan()
    assert plan == json.loads(json.dumps(trial.rank_plan(study=study, candidate=candidate)))
    assert trial.reference_key(study) == key
    stored = json.loads((tmp_path / "t" / "result.json").read_text())
    assert stored["outcome"] == "oom" and stored["stopped_at"] == "step 1" and stored["step_time_s"] is None
    data = trial_json(result=result, ledger=None, tolerance=1e-4, trial_dir="t", study="cpu-tiny")
    assert data["stopped_at"] == "step 1"
    table = trial_table(data)
    assert "stopped at step 1" in table and "measured until it stopped" in table and "2 step(s) run" in table
    _fake_launch(monkeypatch, reports={r: rank_report(r, losses=[2.0, 1.9, 1.8, 1.7, 1.6]) for r in (0, 1)},
                 returncode=0)
    plain = trial.run_trial(study=study, candidate=candidate, trial_dir=tmp_path / "t")
    assert plain.outcome is Outcome.OK and plain.stopped_at is None
    low, high = plain.step_time_range_s
    assert low <= plain.step_time_s <= high
    table = trial_table(trial_json(result=plain, ledger=None, tolerance=1e-4, trial_dir="t", study="cpu-tiny"))
    assert f"median of {len(plain.ranks[0].step_times_s)} measured steps" in table  # and the spread it hides
    assert f"fastest {low:.4f} s, slowest {high:.4f} s" in table
    assert "stop_above" not in json.loads((tmp_path / "t" / "plan.json").read_text())


def test_the_study_passes_the_budget_as_the_ranks_measure_it(repo_root):
    # A study's launch stops the ranks at the per-device budget as each rank measures it: the budget less the
    # device reserve (added back by the objective), plus on CPU ranks the ledger's host items, which one memory
    # holds beside the device share (cpu-tiny, ZeRO-1 with the optimizer on the host: Adam's states live there).
    from dataclasses import replace

    from launchers.study.study_run import stop_above
    from optimizer.ledger.core import evaluate
    from optimizer.study.knobs import OffloadDevice, ZeroStage
    from optimizer.study.specs import baseline_candidate
    from optimizer.study.study_file import load_study

    tiny = load_study(repo_root / "studies" / "cpu-tiny.yaml")
    spec = replace(tiny, hardware=replace(tiny.hardware, gpu_memory_bytes=10_000_000, device_reserve_bytes=1_000))
    offloaded = replace(baseline_candidate(spec.training), zero_stage=ZeroStage.OPTIMIZER,
                        offload_optimizer=OffloadDevice.CPU)
    ledger = evaluate(candidate=offloaded, model=spec.model, hardware=spec.hardware, training=spec.training).ledger
    host = ledger.training_host_share_bytes
    assert host > 0  # the offloaded states
    limits = stop_above(spec, offloaded)
    assert limits.training_bytes == 10_000_000 - 1_000 + host
    assert limits.init_bytes == 10_000_000 - 1_000 + ledger.init_bytes - ledger.init_bytes_at(Location.GPU)
    assert stop_above(spec, offloaded, ledger=ledger) == limits  # the study's own ledger, evaluated once
