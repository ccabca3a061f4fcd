"""Studies with real DeepSpeed on 2 CPU ranks: search, pruning, export, Pareto files, SIGINT and resume."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from trial_processes import trial_processes

from launchers.probe.machine import cached_probe
from launchers.study.study_run import default_storage, run_study
from launchers.trial.run import run_trial
from optimizer.cli import main
from optimizer.results.pareto import feasible_front
from optimizer.results.trial_result import Outcome
from optimizer.search.coordination import launches_used
from optimizer.search.ordering import over_budget_trials
from optimizer.search.progress import counts
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
TrialState = optuna.trial.TrialState


def small_study(folder: Path, **space) -> Path:
    raw = yaml.safe_load((ROOT / "studies" / "demo-cpu.yaml").read_text())
    raw["name"] = "small"
    raw["search_space"] = {"knobs": space or {"zero_stage": [0, 1, 2], "precision": ["fp32", "bf16"],
                                              "checkpointing": ["none", "full"], "micro_batch_size": [1, 2, 4]}}
    path = folder / "small.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    spec = load_study(small_study(tmp_path_factory.mktemp("study")))
    with pytest.MonkeyPatch.context() as patch:  # the study's first step: the probe of the machine (tests/conftest.py)
        patch.delenv("DSOPT_PROBE")
        study = run_study(spec=spec, storage=default_storage(spec), n_trials=7, timeout_s=None)
    return spec, study


def test_the_study_probed_the_machine_first_and_cached_it(finished):
    spec, _ = finished
    probe = cached_probe(spec)
    assert probe is not None and probe.find("gemm", precision="fp32", micro_batch=spec.training.micro_batch_size)
    assert probe.of_kind("engine_micro")  # DeepSpeed's engine at each stage, on the study's skeleton
    # at the end of the FP32 reference's launch (launchers/rank/probe_rank.py, after_trial): no launch of its own,
    # and the reference's recorded wall time is its own, the probe's seconds taken out
    folder = spec.output_dir / "reference"
    assert sorted(p.name for p in folder.glob("probe_rank*.json")) == ["probe_rank0.json", "probe_rank1.json"]
    (end,) = [r for r in map(json.loads, (spec.output_dir / "launches.jsonl").read_text().splitlines())
              if r["event"] == "end" and r["trial_dir"] == str(folder)]
    own = json.loads((folder / "result.json").read_text())["wall_s"]
    assert own > 0 and end["wall_s"] - own >= probe.seconds * 0.99


def test_a_small_study_completes(finished):
    _, study = finished
    c = counts(study)
    assert c["measured"] >= 2 and c["running"] == 0
    # --n-trials counts real launches: the FP32 reference (run here, not cached) and every trial's launches
    assert study.user_attrs["dsopt_reference_launches"] == 1
    assert launches_used(study.get_trials(), reference_launches=1) == 7
    assert study.best_trials
    for trial in study.best_trials:
        assert trial.user_attrs["outcome"] == "ok" and trial.user_attrs["loss_fidelity"] <= 2e-2


def test_pruned_trials_never_started_a_process(finished):
    spec, study = finished
    trials = study.get_trials()
    launched = {Path(t.user_attrs["trial_dir"]).name for t in trials if "trial_dir" in t.user_attrs}
    folders = {p.name for p in (spec.output_dir / "trials").iterdir()}
    assert folders == launched  # every folder is a launch the objective made
    for trial in trials:
        if trial.state is TrialState.PRUNED:
            assert "trial_dir" not in trial.user_attrs and "outcome" not in trial.user_attrs
            assert trial.user_attrs["pruned_reason"]
            slug = (with_knobs(baseline_candidate(spec.training), trial.user_attrs["candidate"])).folder_name()
            # its candidate's folder, if any, is another trial's launch of the same candidate: a held (risky)
            # candidate the launch policy enqueued later, or one that failed and was proposed again
            makers = [t for t in trials if Path(t.user_attrs.get("trial_dir", "")).name == slug]
            assert all(t.state is not TrialState.PRUNED and t.user_attrs["label"] == trial.user_attrs["label"]
                       for t in makers)


def test_export_loads_in_deepspeed_and_trains(finished, capsys):
    spec, study = finished
    out = spec.output_dir / "exported.json"
    assert main(["export", str(spec.path), "--pick", "fastest", "--out", str(out)]) == 0
    config = json.loads(out.read_text())
    # the fastest front point measured within the headroom (budget.headroom: 3 % of gpu_memory on CPU ranks)
    usable = spec.budget.headroom_for(spec.hardware.accelerator).usable_bytes(spec.hardware.gpu_memory_bytes)
    fastest = max((t for t in feasible_front(study) if t.values[0] <= usable), key=lambda t: t.values[1])
    assert f"picked trial #{fastest.number} (fastest): {fastest.user_attrs['label']}\n" in capsys.readouterr().out
    candidate = with_knobs(baseline_candidate(spec.training), fastest.user_attrs["candidate"])
    result = run_trial(study=spec, candidate=candidate, trial_dir=spec.output_dir / "export-check", ds_config=config)
    assert result.outcome is Outcome.OK, result.message + result.log_tail
    assert len(result.losses) == spec.trial.warmup_steps + spec.trial.measured_steps
    assert main(["export", str(spec.path), "--pick", "fastest", "--out", str(out)]) == 2  # no overwrite
    assert main(["export", str(spec.path), "--pick", "balanced", "--hf", "--out", str(out), "--force"]) == 0
    assert json.loads(out.read_text())["train_micro_batch_size_per_gpu"] == "auto"


def test_pareto_files_contain_the_measured_trials(finished, capsys):
    spec, study = finished
    out = spec.output_dir / "plots"
    assert main(["pareto", str(spec.path), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    html = (out / "pareto.html").read_text()
    assert (out / "pareto.png").stat().st_size > 10_000
    for trial in feasible_front(study):
        assert f"{trial.number:>5}" in table
        assert json.dumps(trial.values[1])[:8] in html  # the measured throughput is plotted


def test_the_study_stores_its_calibration_and_shows_it(finished, capsys):
    spec, study = finished
    stored = study.user_attrs["dsopt_calibration"]
    measured = [t for t in study.get_trials() if t.state is TrialState.COMPLETE and "reused_from" not in t.user_attrs]
    # measured over the budget and reached the measured steps: their time counts (a run stopped at the first
    # step over the budget has a device share but no step time)
    over = [t for t in over_budget_trials(study.get_trials()) if t.user_attrs.get("step_time_s")]
    # Refitted before each trial: it covers every measured trial but possibly the last one.
    timed = len(measured) + len(over)
    assert timed - 1 <= stored["time_samples"] <= timed and "memory_factors" in stored
    assert main(["ledger", str(spec.path), "--calibrated"]) == 0
    out = capsys.readouterr().out
    for trial in measured:
        assert f"| {trial.number} | " in out  # one row per measured trial, predicted vs measured
    assert "fitted seconds per unit" in out


def _no_rank_left(folder: Path) -> bool:
    """No rank of this test's own study (under ``folder``) is alive; other dsopt runs on the machine are not ours."""
    return trial_processes(folder) == []


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupt_then_resume_loses_and_repeats_nothing(tmp_path, sig, status):
    """Ctrl-C, or SIGTERM as a batch system ends a job (SLURM at its time limit, ``scancel``): the running trial is
    recorded as failed, no rank is left, and the same command resumes with nothing lost or launched twice."""
    path = small_study(tmp_path, zero_stage=[0, 1, 2, 3], precision=["fp32", "bf16"], micro_batch_size=[1, 2])
    spec = load_study(path)
    storage = default_storage(spec)
    # SIGINT as a terminal delivers it: a suite started in the background (`cmd &` without job control) has
    # SIGINT ignored, which children inherit, and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen([sys.executable, "-m", "optimizer.cli", "study", "run", str(path), "--n-trials", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 400
    completed_before: list[str] = []
    while time.monotonic() < deadline:
        time.sleep(2)
        if not (spec.output_dir / "study.db").exists():
            continue
        try:
            trials = optuna.load_study(study_name=spec.name, storage=storage).get_trials()
        except KeyError:
            continue
        done = [t for t in trials if t.state is TrialState.COMPLETE]
        # interrupt early, with trials still to come, so a slow poll on a loaded machine cannot miss the run
        if done and len(done) <= 4 and any(t.state is TrialState.RUNNING for t in trials):
            completed_before = [t.user_attrs["label"] for t in done]
            break
    assert completed_before, "no trial completed while another was running"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err[-2000:]
    assert "the running trial is recorded as failed" in err, err[-2000:]
    assert _no_rank_left(tmp_path)
    interrupted = optuna.load_study(study_name=spec.name, storage=storage)
    assert any(t.state is TrialState.FAIL for t in interrupted.get_trials())
    study = run_study(spec=spec, storage=storage, n_trials=3, timeout_s=None)
    complete = [t for t in study.get_trials() if t.state is TrialState.COMPLETE]
    keys_after = [t.user_attrs["label"] for t in complete]
    assert all(key in keys_after for key in completed_before)  # nothing completed was lost
    measured = [t.user_attrs["label"] for t in complete if "reused_from" not in t.user_attrs]
    assert len(measured) == len(set(measured))  # nothing was launched twice


def test_a_transient_crash_is_retried_once_and_the_result_reused(tmp_path):
    # A real study whose one bf16 candidate's rank 1 is SIGKILLed on its first launch only (a co-tenant, an NCCL
    # hiccup): the trial launches again (trial.retries: 1) and completes; the next sample of the candidate reuses it.
    shutil.copy(ROOT / "tests" / "real" / "deepspeed" / "faulty_workloads.py", tmp_path / "faulty_workloads.py")
    raw = yaml.safe_load((ROOT / "studies" / "cpu-tiny.yaml").read_text())
    raw["name"] = "retry"
    raw["model"]["entry_point"] = "faulty_workloads:crash_once_workload"
    raw["search_space"] = {"knobs": {"precision": ["bf16"]}}
    path = tmp_path / "retry.yaml"
    path.write_text(yaml.safe_dump(raw))
    spec = load_study(path)
    study = run_study(spec=spec, storage=default_storage(spec), n_trials=2, timeout_s=None)
    assert (tmp_path / "crashed_once.marker").exists()  # the first launch did crash
    launched = [t for t in study.get_trials() if "reused_from" not in t.user_attrs and "attempts" in t.user_attrs]
    assert len(launched) == 1, [t.user_attrs for t in study.get_trials()]
    trial = launched[0]
    assert trial.state is TrialState.COMPLETE and trial.user_attrs["attempts"] == 2
    assert trial.user_attrs["failed_attempts"][0]["outcome"] == "crash"
    # every other trial of the one candidate reused it (the study may also stop once the space is measured)
    assert all(t.user_attrs.get("reused_from") == trial.number for t in study.get_trials() if t.number != trial.number)
    launches = [json.loads(line) for line in (spec.output_dir / "launches.jsonl").read_text().splitlines()]
    ends = [r["outcome"] for r in launches if r["event"] == "end" and r["candidate"]["precision"] == "bf16"]
    assert ends == ["crash", "ok"]  # two launches of the candidate, no more
