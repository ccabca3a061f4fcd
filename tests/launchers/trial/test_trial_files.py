"""What a trial leaves on disk and reads back: JIT-build locks of killed ranks, result.json (versions, host memory
seen, an OOM kill recorded), and the FP32 reference cache keyed on the library versions."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from trial_fixtures import NEAR, GiB, library_versions, rank_report

from optimizer.results.trial_result import Outcome
from optimizer.study.specs import baseline_candidate


def test_stale_build_locks_are_cleared_but_fresh_ones_kept(tmp_path):
    import os
    import time

    from launchers.trial.local import clear_stale_build_locks

    stale = tmp_path / "py311_cpu" / "fused_adam" / "lock"
    fresh = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - 86400  # a day: past any rule for unrecorded locks
    os.utime(stale, (old, old))
    assert clear_stale_build_locks(tmp_path) == [stale]
    assert not stale.exists() and fresh.exists()


def _tiny_study(repo_root, tmp_path):
    import shutil

    from optimizer.study.study_file import load_study

    shutil.copy(repo_root / "studies" / "cpu-tiny.yaml", tmp_path / "cpu-tiny.yaml")
    return load_study(tmp_path / "cpu-tiny.yaml")  # outputs go to tmp_path/cpu-tiny/


def _fake_launch(monkeypatch, *, reports, returncode, evidence=None):
    """Replace the launch (no ranks start): ``reports`` are written as the ranks' ``rank<r>.json``."""
    import json

    import launchers.trial.run as trial
    from launchers.trial.local import Execution

    def execute(plan, *, timeout_s, log_path):
        out_dir = Path(plan.argv[-1])  # launchers.rank.trial_rank PLAN.json OUT_DIR
        for rank, report in reports.items():
            (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
        log_path.write_text("torchrun log\n")
        return Execution(returncode=returncode, timed_out=False, wall_s=0.5)

    monkeypatch.setattr(trial, "execute", execute)
    if evidence is not None:
        class Watch:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return None

            def evidence(self):
                return evidence

        monkeypatch.setattr(trial, "HostWatch", Watch)


def test_result_json_carries_the_versions_and_the_host_memory_seen(repo_root, tmp_path, monkeypatch):
    import json

    from launchers.trial.run import run_trial
    from optimizer.study.specs import baseline_candidate

    study = _tiny_study(repo_root, tmp_path)
    _fake_launch(monkeypatch, reports={0: rank_report(0, losses=[2.0, 1.9, 1.8, 1.7, 1.6]),
                                       1: rank_report(1, losses=[2.0, 1.9, 1.8, 1.7, 1.6])}, returncode=0)
    result = run_trial(study=study, candidate=baseline_candidate(study.training), trial_dir=tmp_path / "t")
    assert result.outcome is Outcome.OK
    data = json.loads((tmp_path / "t" / "result.json").read_text())
    # the four libraries, each as it reports its own version (not through dsopt's metadata lookup)
    assert data["versions"] == library_versions(repo_root)
    assert data["host_memory"]["samples"] >= 1  # the real watch ran around the (fake) launch


def test_a_launch_the_oom_killer_ended_is_recorded_as_oom_host(repo_root, tmp_path, monkeypatch):
    import json

    from launchers.trial.run import run_trial
    from optimizer.study.specs import baseline_candidate

    study = _tiny_study(repo_root, tmp_path)
    _fake_launch(monkeypatch, reports={}, returncode=-9, evidence=NEAR)
    result = run_trial(study=study, candidate=baseline_candidate(study.training), trial_dir=tmp_path / "t")
    assert result.outcome is Outcome.OOM_HOST
    data = json.loads((tmp_path / "t" / "result.json").read_text())
    assert data["outcome"] == "oom_host" and data["host_memory"]["peak_used_bytes"] == 31 * GiB


def test_a_reference_cached_under_other_versions_is_run_again(repo_root, tmp_path, monkeypatch):
    import json

    import launchers.trial.run as trial
    from optimizer.results.trial_result import TrialResult

    study = _tiny_study(repo_root, tmp_path)
    current = library_versions(repo_root)  # as the libraries report themselves, not through dsopt's lookup
    key = trial.reference_key(study)
    assert re.fullmatch("[0-9a-f]{64}", key)  # a SHA-256 digest, hex
    assert trial.reference_key(study, versions=current) == key  # the default is the versions installed here
    other = {**current, "deepspeed": "0.16.0"}
    changed = [trial.reference_key(study, versions={**current, name: version}) for name, version in
               (("torch", "2.5.1"), ("deepspeed", "0.16.0"), ("transformers", None), ("dsopt", "0.0.1"))]
    assert len({key, *changed}) == 5  # each version, changed alone, gives a key of its own
    runs = []

    def run_trial(**kwargs):  # the reference launch, without ranks
        runs.append(kwargs["candidate"])
        return TrialResult(outcome=Outcome.OK, losses=(2.0, 1.5))

    monkeypatch.setattr(trial, "run_trial", run_trial)
    cache = study.output_dir / "reference.json"
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"key": trial.reference_key(study, versions=other), "versions": other,
                                 "losses": [9.0, 9.0]}))
    stale = json.loads(cache.read_text())["key"]
    assert trial.reference_losses(study) == [2.0, 1.5]  # not the stale 9.0s
    assert len(runs) == 1
    stored = json.loads(cache.read_text())
    # cpu-tiny's baseline: FP32 at stage 0 fits its 2 GiB ranks, so it is the reference (launchers/trial/run.py)
    assert stored == {"key": key, "versions": current, "losses": [2.0, 1.5], "draws_random": False,
                      "candidate": {"zero_stage": 0, "offload_optimizer": "none", "offload_param": "none",
                                    "precision": "fp32", "checkpointing": "none", "micro_batch_size": 2}}
    assert stored["key"] != stale
    assert trial.reference_losses(study) == [2.0, 1.5] and len(runs) == 1  # now served from the cache


def test_a_reference_that_crashed_is_launched_once_more_as_a_trial_would_be(repo_root, tmp_path, monkeypatch):
    # A rank that aborted at exit after writing its report ("terminate called without an active exception", seen
    # once on CPU ranks) made the FP32 reference a crash, and the study stopped; a trial's crash is retried
    import launchers.trial.run as trial
    from optimizer.results.trial_result import TrialResult

    study = _tiny_study(repo_root, tmp_path)
    outcomes = [Outcome.CRASH, Outcome.OK]

    def run_trial(**kwargs):  # the reference launch, without ranks
        outcome = outcomes.pop(0)
        return TrialResult(outcome=outcome, losses=(2.0, 1.5) if outcome is Outcome.OK else ())

    monkeypatch.setattr(trial, "run_trial", run_trial)
    assert trial.reference_losses(study) == [2.0, 1.5] and outcomes == []
    (study.output_dir / "reference.json").unlink()
    outcomes.extend([Outcome.CRASH, Outcome.CRASH])  # trial.retries = 1: the second crash stands
    with pytest.raises(trial.ReferenceFailed):
        trial.reference_losses(study)
    outcomes.extend([Outcome.OOM])  # a property of the candidate: not launched again
    with pytest.raises(trial.ReferenceFailed):
        trial.reference_losses(study)
    assert outcomes == []


def test_the_reference_run_is_read_back_as_the_trial_of_its_candidate_only(repo_root, tmp_path, monkeypatch):
    import json

    import launchers.trial.run as trial
    from launchers.trial.reference_trial import reference_as_trial
    from optimizer.results.trial_result import TrialResult

    study = _tiny_study(repo_root, tmp_path)
    base = baseline_candidate(study.training)  # cpu-tiny's reference (the test above)
    folder = study.output_dir / "reference"

    def run_trial(**kwargs):  # the reference launch: its ranks' reports and result.json, as a launch leaves them
        kwargs["trial_dir"].mkdir(parents=True, exist_ok=True)
        for rank in range(2):
            (kwargs["trial_dir"] / f"rank{rank}.json").write_text(json.dumps(rank_report(rank)))
        (kwargs["trial_dir"] / "result.json").write_text(json.dumps({"outcome": "ok", "wall_s": 12.5}))
        return TrialResult(outcome=Outcome.OK, losses=(2.0, 1.5, 1.0))

    assert reference_as_trial(study, base, trial_dir=tmp_path / "t") is None  # no reference run yet
    monkeypatch.setattr(trial, "run_trial", run_trial)
    trial.reference_losses(study)
    result = reference_as_trial(study, base, trial_dir=tmp_path / "t")
    # summarised as a launch is: each rank's measured steps took 0.2 and 0.4 s, so the median of the slowest per step
    # is 0.3 s; cpu-tiny's 8 rows × 64 tokens per step; its own losses as the reference: fidelity 0
    assert result.outcome is Outcome.OK and result.loss_fidelity == 0.0 and result.wall_s == 12.5
    assert result.step_time_s == pytest.approx(0.3) and result.tokens_per_s == pytest.approx(8 * 64 / 0.3)
    assert result.peak_memory_bytes == 101  # rank 1's
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["rank0.json", "rank1.json", "result.json"]
    other = dataclasses.replace(base, micro_batch_size=1)
    assert reference_as_trial(study, other, trial_dir=tmp_path / "u") is None and not (tmp_path / "u").exists()
    (folder / "rank0.json").write_text(json.dumps(rank_report(0, losses=[9.0, 9.0, 9.0])))  # not the cached run
    assert reference_as_trial(study, base, trial_dir=None) is None
