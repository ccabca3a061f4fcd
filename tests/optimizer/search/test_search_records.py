"""What the search records and prints: optimizer/search/objective.py's trial attributes and constraints,
untried.py's queued candidates, storage.py's load_stored errors, progress.py's status text,
coordination.py's worker id and calibration_report.py's memory columns.

Figures, each worked by hand or taken from a cited source:

* The seed study (studies/seed-1b-2x24gb.yaml, 24 GB = 24·10^9 bytes per GPU): plain data parallel, fp32, needs
  4 + 4 + 8 + 8 + 2 = 26 GB per GPU (the seed document, Q130; tests/optimizer/ledger/test_seed_ledger.py): fp32
  parameters 4Ψ,
  gradients 4Ψ, Adam 8Ψ, activations 8 GB (backward), buffers 2 GB; no allocator overhead, no reserve, and no
  init-phase item (the seed's table has none), so its init need is 0; on a 10 GB budget it is pruned.
* cpu-tiny (studies/cpu-tiny.yaml): 2 CPU ranks, global batch 8, sequence 64, 2 GiB per rank; its baseline
  (z0 fp32 mbs=2) needs a few MB (tests/optimizer/search/test_objective_units.py), so a 3 MB measurement is within
  budget.
* MB = 10^6 bytes (calibration_report's header).
"""

from __future__ import annotations

import os
import socket
from dataclasses import replace

import optuna
import pytest

from optimizer.perf.throughput import FEATURES, Rates
from optimizer.results.trial_result import Outcome, RankMeasurement, TrialResult
from optimizer.search import storage as storage_module
from optimizer.search.calibration_report import calibration_table
from optimizer.search.coordination import worker_id
from optimizer.search.objective import DIRECTIONS, UNKNOWN_FIDELITY, make_objective
from optimizer.search.ordering import StudyModels
from optimizer.search.progress import duration_text, status_text
from optimizer.search.space import branches, distribution_params
from optimizer.search.storage import load_stored
from optimizer.search.untried import untried_options
from optimizer.study.cluster_settings import WorkerSettings
from optimizer.study.errors import UserError
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

TrialState = optuna.trial.TrialState


@pytest.fixture(autouse=True)
def _quiet():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def _no_models() -> StudyModels:
    """Nothing measured: no factor, the profile's rates (unknown), no calibration."""
    return StudyModels(rates=Rates(seconds_per=tuple(None for _ in FEATURES), source="none"), memory_factors=(),
                       time_samples=0, measured_fits=frozenset())


def _asked(study: optuna.Study, spec, candidate) -> optuna.Trial:
    study.enqueue_trial(distribution_params(candidate, branches(spec)))
    return study.ask()


# --- objective.py -------------------------------------------------------------------------------------------------

def test_a_pruned_seed_trial_records_its_predictions_and_its_ledger(seed_study_path):
    stated = load_study(seed_study_path)
    seed = replace(stated, hardware=replace(stated.hardware, gpu_memory_bytes=10 * 10**9))  # 10 GB: far too small
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, seed, baseline_candidate(seed.training))
    objective = make_objective(spec=seed, space=branches(seed), runner=lambda c: pytest.fail("launched"),
                               models=_no_models)
    with pytest.raises(optuna.TrialPruned):
        objective(trial)
    attrs = trial.user_attrs
    assert attrs["predicted_bytes"] == 26 * 10**9
    assert attrs["predicted_gpu_needed_bytes"] == 26 * 10**9  # reserved (overhead 0) + reserve 0
    assert attrs["predicted_training_needed_bytes"] == 26 * 10**9
    assert attrs["predicted_init_needed_bytes"] == 0  # no init-phase item in the seed's table
    assert attrs["predicted_host_bytes"] == 0 and attrs["predicted_init_host_bytes"] == 0  # GPUs
    assert attrs["pruned_reason"].startswith("does not fit: ")
    ledger = attrs["ledger"]
    assert (ledger["valid"], ledger["fits"], ledger["fits_gpu"]) == (True, False, False)
    per_gpu = ledger["per_gpu"]
    assert (per_gpu["params"], per_gpu["grads"], per_gpu["optimizer"], per_gpu["activations"],
            per_gpu["buffers"]) == (4 * 10**9, 4 * 10**9, 8 * 10**9, 8 * 10**9, 2 * 10**9)
    assert (per_gpu["total"], per_gpu["reserved"], per_gpu["needed"], per_gpu["capacity"],
            per_gpu["device_reserve"]) == (26 * 10**9, 26 * 10**9, 26 * 10**9, 10 * 10**9, 0)


def _ok_without_fidelity() -> TrialResult:
    rank = RankMeasurement(rank=0, peak_allocated_bytes=3_000_000, peak_reserved_bytes=None, peak_rss_bytes=10**8,
                           step_times_s=(0.1,), training_peak_allocated_bytes=3_000_000,
                           init_peak_allocated_bytes=1_000_000)
    return TrialResult(outcome=Outcome.OK, ranks=(rank,), losses=(5.0,), step_time_s=0.1, tokens_per_s=1000.0,
                       loss_fidelity=None, wall_s=7.25)


def test_a_launch_of_unknown_fidelity_is_recorded_unknown_and_infeasible(tiny):
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    calls: list[str] = []

    def runner(candidate):
        calls.append(candidate.label())
        return _ok_without_fidelity()

    values = make_objective(spec=tiny, space=branches(tiny), runner=runner)(trial)
    # no offload: the device share is the training peak, 3,000,000 B (reserve 0); tokens/s as reported
    assert values == (3_000_000.0, 1000.0)
    attrs = trial.user_attrs
    assert calls == ["z0 fp32 ckpt=none mbs=2"]
    assert attrs["fidelity_unknown"] is True and attrs["loss_fidelity"] is None
    assert (attrs["tokens_per_s"], attrs["step_time_s"], attrs["outcome"]) == (1000.0, 0.1, "ok")
    assert UNKNOWN_FIDELITY == 1.0  # documented: violated (> 0), never feasible
    # init: 1,000,000 B of a 2 GiB = 2,147,483,648 B budget: (10^6 − 2^31)/2^31 = −0.99953433...
    assert trial.constraints == {"loss_fidelity": 1.0,
                                 "init_memory": pytest.approx((1_000_000 - 2**31) / 2**31, rel=1e-12)}


# --- untried.py ---------------------------------------------------------------------------------------------------

def test_an_enqueued_candidate_is_still_untried(tiny):
    """cpu-tiny's space has the baseline z0 fp32 ckpt=none mbs=2; enqueued (WAITING, its params fixed), it was
    never launched, so a stop still lists it."""
    spec = tiny
    study = optuna.create_study(directions=list(DIRECTIONS))
    base = baseline_candidate(spec.training)
    study.enqueue_trial(distribution_params(base, branches(spec)))
    (queued,) = study.get_trials(deepcopy=False)
    assert queued.state is TrialState.WAITING
    labels = [o.candidate.label() for o in untried_options(spec, [queued])]
    assert "z0 fp32 ckpt=none mbs=2" in labels
    assert labels == [o.candidate.label() for o in untried_options(spec, [])]  # queued: as if nothing ran


# --- storage.py ---------------------------------------------------------------------------------------------------

def test_a_backend_failure_while_loading_names_the_storage_and_the_error(tmp_path, monkeypatch):
    journal = tmp_path / "study.log"
    journal.write_text("")
    url = f"journal://{journal}"
    monkeypatch.setattr(storage_module, "open_storage", lambda u, *, workers: optuna.storages.InMemoryStorage())

    def boom(**_kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(optuna, "load_study", boom)
    with pytest.raises(UserError) as caught:
        load_stored(name="s", default_path=tmp_path / "unused.db", storage=url, study_path=tmp_path / "s.yaml",
                    workers=WorkerSettings())
    assert (caught.value.source, caught.value.key) == ("--storage", url)
    assert caught.value.why == "cannot open the study storage: RuntimeError: boom"


# --- progress.py --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("seconds", "text"), [
    (None, "?"), (-1.0, "?"), (float("inf"), "?"), (0, "0s"), (59.4, "59s"),
    (60, "1m00s"),  # exactly a minute: 60 // 60 = 1, 60 % 60 = 0
    (59.6, "1m00s"), (245, "4m05s"), (3599, "59m59s"),
    (3600, "1h00m"), (3725, "1h02m")])  # 3725 = 3600 + 2·60 + 5
def test_duration_text(seconds, text):
    assert duration_text(seconds) == text


def test_status_text_counts_a_failure():
    assert status_text(counts={"failed": 2}, ran=2, launches=2, target=None, now=None, best=None,
                       eta_s=None) == "launches 2 · trials 2 · failed 2 · best none yet"


def test_status_text_with_every_part():
    counts = {"measured": 3, "reused": 1, "pruned": 2, "held": 1, "failed": 2, "running": 1}
    text = status_text(counts=counts, ran=9, launches=6, target=10, now="z1 bf16 ckpt=none mbs=1",
                       best=(4, 1234.4), eta_s=125.0)
    assert text == ("launches 6/10 (retries, reference incl.) · trials 9 · measured 3 reused 1 pruned 2 held 1 "
                    "failed 2 · now z1 bf16 ckpt=none mbs=1 · best #4 1,234 tok/s · ETA 2m05s")


# --- coordination.py ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("env", "suffix"), [
    ({"SLURM_ARRAY_JOB_ID": "123", "SLURM_ARRAY_TASK_ID": "4", "SLURM_JOB_ID": "130"}, "/123_4"),
    ({"SLURM_ARRAY_JOB_ID": "123", "SLURM_JOB_ID": "130"}, "/130"),
    ({"SLURM_ARRAY_TASK_ID": "4", "SLURM_JOB_ID": "130"}, "/130"),
    ({"SLURM_JOB_ID": "130"}, "/130"),
    ({}, "")])
def test_worker_id_names_host_pid_and_the_slurm_job(monkeypatch, env, suffix):
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    assert worker_id() == "node7:4242" + suffix


# --- calibration_report.py ----------------------------------------------------------------------------------------

def test_gigabyte_measurements_print_in_mb_exactly(tiny):
    """2,000,000,000 B measured = 2000.000 MB; ledger 2,500,000,000 B = 2500.000 MB, err (2500 − 2000)/2000 =
    +25.0 %; factor 1.1: 2750.000 MB, err +37.5 %. Calibrated rates: 0.5 s per ZeRO-0 micro-step, cpu-tiny
    mbs 2: 8/(2·2) = 2 micro-steps, 1.0 s, 8·64/1.0 = 512 tokens/s, err (512 − 400)/400 = +28.0 %
    (tests/optimizer/search/test_calibration_report_units.py); the profile is unknown (no hardware.profile)."""
    knobs = {"zero_stage": 0, "offload_optimizer": "none", "offload_param": "none", "precision": "fp32",
             "checkpointing": "none", "micro_batch_size": 2}
    trial = optuna.trial.create_trial(
        state=TrialState.COMPLETE, values=[2e9, 400.0],
        user_attrs={"candidate": knobs, "step_time_s": 1.0, "tokens_per_s": 400.0,
                    "device_share_bytes": 2_000_000_000, "predicted_training_needed_bytes": 2_500_000_000})
    models = StudyModels(rates=Rates(seconds_per=tuple(0.5 if n == "micro_steps_z0" else 0.0 for n in FEATURES),
                                     source="calibrated on 1 trials"),
                         memory_factors=(("z0-fp32-none-optnone-pnone", 1.1),), time_samples=1,
                         measured_fits=frozenset())
    study = optuna.create_study(directions=list(DIRECTIONS))
    study.add_trial(trial)
    lines = calibration_table(spec=tiny, trials=study.trials, models=models).splitlines()
    assert lines[4] == ("| 0 | z0 fp32 ckpt=none mbs=2 | 2000.000 | 2500.000 | +25.0% | 2750.000 | +37.5% | 400 "
                        "| unknown | - | 512 | +28.0% |")
