"""What a running study prints (optimizer/search/progress.py formats, launchers/study/progress.py prints): one concise
line per finished trial, a status line, JSON lines for scripts. The study test replays stated measurements through
``run_study``'s runner (no DeepSpeed: the printing is under test, not the trial)."""

from __future__ import annotations

import io
import json

import optuna

from launchers.study.progress import Progress, ProgressMode
from launchers.study.study_run import run_study
from optimizer.results.trial_result import Outcome, RankMeasurement, TrialResult
from optimizer.search.progress import duration_text, eta_s, status_text, trial_line, trial_summary
from optimizer.study.knobs import Precision, ZeroStage
from optimizer.study.specs import baseline_candidate


def _trial(state, *, values=None, **attrs):
    """A finished trial with its number: added to a study of dsopt's two objectives."""
    study = optuna.create_study(directions=["minimize", "maximize"])
    study.add_trial(optuna.trial.create_trial(state=state, values=values, user_attrs=attrs))
    return study.trials[-1]


def test_a_measured_trial_is_one_line_with_its_label_memory_speed_and_front(tiny):
    base = baseline_candidate(tiny.training)
    knobs = {**base.knobs(), "zero_stage": 2, "precision": "bf16", "checkpointing": "full", "micro_batch_size": 4}
    frozen = _trial(optuna.trial.TrialState.COMPLETE, values=[2_440_000.0, 10_099.4], candidate=knobs)
    line = trial_line(trial_summary(frozen, base=base, on_front=True))
    assert line.split() == ["#0", "z2", "bf16", "ckpt=full", "mbs=4", "2.44", "MB", "10,099", "tok/s", "✓", "front"]
    behind = trial_line(trial_summary(frozen, base=base, on_front=False))
    assert behind.endswith("tok/s") and "front" not in behind


def test_pruned_held_failed_and_reused_trials_say_why(tiny):
    base = baseline_candidate(tiny.training)
    knobs = base.knobs()
    pruned = _trial(optuna.trial.TrialState.PRUNED, candidate=knobs,
                    pruned_reason="does not fit: GPU needs 3.43 MB of 3.00 MB")
    held = _trial(optuna.trial.TrialState.PRUNED, candidate=knobs, held=True, pruned_reason="held: " + "x" * 200)
    failed = _trial(optuna.trial.TrialState.FAIL, candidate=knobs, outcome="oom", message="measured 3.137 MB")
    reused = _trial(optuna.trial.TrialState.COMPLETE, values=[1e6, 5.0], candidate=knobs, reused_from=3)
    lines = [trial_line(trial_summary(t, base=base, on_front=False)) for t in (pruned, held, failed, reused)]
    assert lines[0].endswith("pruned: does not fit: GPU needs 3.43 MB of 3.00 MB")
    assert " held: x" in lines[1] and lines[1].endswith("…") and len(lines[1].split(": ", 1)[1]) == 80
    assert lines[2].endswith("oom: measured 3.137 MB")
    assert lines[3].endswith("(reused)")
    assert {trial_summary(t, base=base, on_front=False)["status"] for t in (pruned, held, failed, reused)} == \
        {"pruned", "held", "oom", "reused"}


def test_the_status_line_and_its_eta():
    counts = {"measured": 5, "reused": 1, "pruned": 2, "held": 0, "failed": 1, "running": 1}
    text = status_text(counts=counts, ran=9, launches=7, target=16, now="z3 bf16 ckpt=none mbs=2",
                       best=(7, 31_659.2), eta_s=eta_s(wall_s=[10.0, 20.0], left=7))
    assert text == ("launches 7/16 (retries, reference incl.) · trials 9 · measured 5 reused 1 pruned 2 failed 1 · "
                    "now z3 bf16 ckpt=none mbs=2 · best #7 31,659 tok/s · ETA 1m45s")
    assert eta_s(wall_s=[], left=3) is None and duration_text(None) == "?" and duration_text(3725) == "1h02m"
    assert "ETA" not in status_text(counts={}, ran=0, launches=0, target=None, now=None, best=None, eta_s=None)


def test_a_study_in_jsonl_mode_prints_one_record_per_trial_and_nothing_else_on_stdout(tiny, monkeypatch):
    def runner(candidate, _reference):
        peak = 1_000_000 + 100_000 * candidate.micro_batch_size
        rank = RankMeasurement(rank=0, peak_allocated_bytes=peak, peak_reserved_bytes=None, peak_rss_bytes=0,
                               step_times_s=(0.1,), training_peak_allocated_bytes=peak)
        return TrialResult(outcome=Outcome.OK, ranks=(rank,), step_time_s=0.1,
                           tokens_per_s=1000.0 * candidate.micro_batch_size, loss_fidelity=0.0, losses=(5.0,))

    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    study = run_study(spec=tiny, storage=f"sqlite:///{tiny.output_dir / 'study.db'}", n_trials=5, timeout_s=None,
                      runner=runner, reference=lambda: [5.0], progress=ProgressMode.JSONL)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["trial"] for r in records] == [t.number for t in study.trials][-5:]
    measured = [r for r in records if r["status"] == "measured"]
    assert measured and all(r["memory_bytes"] > 0 and r["tokens_per_s"] > 0 for r in measured)
    front = {t.number for t in study.best_trials}
    # "on_front" is the front when the trial finished: the last record's is the final front's, and the final
    # front's trials (those among the records) were on it when they finished (a point is only ever pushed off)
    assert records[-1]["on_front"] == (records[-1]["trial"] in front)
    assert front & {r["trial"] for r in records} <= {r["trial"] for r in records if r["on_front"]}
    assert front
    assert "stopping: this worker made its 5 launch(es) (retries and the FP32 reference included)" in err.getvalue()
    assert sum(1 for t in study.trials if "launches" in t.user_attrs) == 5  # pruned and reused ones spend none


def test_quiet_mode_prints_no_trial_lines_and_human_mode_one_each(tiny):
    base = baseline_candidate(tiny.training)
    study = optuna.create_study(directions=["minimize", "maximize"])
    knobs = {**base.knobs(), "zero_stage": int(ZeroStage.OPTIMIZER), "precision": str(Precision.BF16)}
    frozen = _trial(optuna.trial.TrialState.COMPLETE, values=[1e6, 5.0], candidate=knobs)
    study.add_trial(frozen)
    for mode, lines in ((ProgressMode.QUIET, 0), (ProgressMode.HUMAN, 1)):
        err = io.StringIO()
        report = Progress(mode, base=base, target=None, worker="w", err=err, out=io.StringIO())
        report.finished(study, study.trials[-1])
        report.close()
        assert len(err.getvalue().splitlines()) == lines
    assert "z1 bf16" in err.getvalue() and "✓ front" in err.getvalue()
