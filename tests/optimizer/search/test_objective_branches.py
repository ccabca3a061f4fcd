"""The objective's launch gate, retries, reuse and records, field by field (optimizer/search/objective.py), and the
setup lease's own-worker and stale rules (optimizer/search/coordination.py); a fake runner, nothing launched.

Figures, each worked by hand or taken from a cited source:

* cpu-tiny (studies/cpu-tiny.yaml): ``gpu_memory: 2 GiB`` = 2^31 = 2,147,483,648 bytes per rank, no device reserve
  (0 on CPU ranks); its baseline is ``z0 fp32 ckpt=none mbs=2`` (tests/optimizer/search/test_search.py), nothing
  offloaded, so the
  ledger puts nothing on the host and the device share is the measured peak. fp32's fidelity tolerance is 1e-4 and
  ``trial.retries`` is 1 (optimizer/study/trial_settings.py defaults; the study file sets neither).
* The risky candidate ``z1 bf16 ckpt=none mbs=4`` under a 2,910,000-byte budget with formula activations, before any
  measurement: need 2,852,352 B = 98.0 % of the budget, margin 495,171 B = 0.495 MB, P = Φ(0.2328) = 0.5921 = 59 %
  (worked in tests/optimizer/search/test_launch_policy.py, BUDGET and
  test_the_best_is_held_at_first_and_the_study_finds_it).
* The budget messages are the ones optimizer/search/coordination.py ``budget_spent`` documents for each limit.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import optuna
import pytest

from optimizer.perf.throughput import FEATURES, Rates
from optimizer.results.trial_result import Outcome, RankMeasurement, TrialResult
from optimizer.search.coordination import REFERENCE_LAUNCHES_ATTR, SetupLease, launches_used
from optimizer.search.objective import DIRECTIONS, LaunchGate, TrialFailed, make_objective, open_study
from optimizer.search.ordering import StudyModels, memory_group
from optimizer.search.space import branches, distribution_params
from optimizer.study.cluster_settings import BudgetSettings
from optimizer.study.knobs import Precision, ZeroStage, parse_checkpointing
from optimizer.study.search_space import SearchSpace
from optimizer.study.specs import ActivationSource, baseline_candidate

BASE_LABEL = "z0 fp32 ckpt=none mbs=2"  # cpu-tiny's baseline (tests/optimizer/search/test_search.py, docs/studies.md)
GIB = 2**30
RISKY = "z1 bf16 ckpt=none mbs=4"
HELD_TAIL = " — launched when the launch policy prices the risk worth it, not on the sampler's proposal"


@pytest.fixture(autouse=True)
def _quiet():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def _asked(study: optuna.Study, spec, candidate, **user_attrs) -> optuna.Trial:
    """A running trial that samples ``candidate`` (enqueued, then asked)."""
    study.enqueue_trial(distribution_params(candidate, branches(spec)), user_attrs=user_attrs or None)
    return study.ask()


def _objective(spec, calls: list, *answers: TrialResult, **kwargs):
    """The objective with a runner that returns ``answers`` in turn (the last one again when they run out)."""
    def runner(candidate):
        calls.append(candidate.label())
        return answers[min(len(calls), len(answers)) - 1]

    return make_objective(spec=spec, space=branches(spec), runner=runner, **kwargs)


def _ok(**rank_fields) -> TrialResult:
    rank = RankMeasurement(rank=0, peak_rss_bytes=10**8, step_times_s=(0.1,), **rank_fields)
    return TrialResult(outcome=Outcome.OK, ranks=(rank,), losses=(5.0,), step_time_s=0.1, tokens_per_s=1000.0,
                       loss_fidelity=0.0, wall_s=7.25)


def _crash(message: str = "port already in use", wall_s: float = 1.5) -> TrialResult:
    return TrialResult(outcome=Outcome.CRASH, message=message, wall_s=wall_s)


# --- a launch, every field recorded ---------------------------------------------------------------------------------

def test_a_launched_trial_records_every_measurement_and_its_constraints(tiny):
    rank = RankMeasurement(rank=0, peak_allocated_bytes=1_200_000_000, peak_reserved_bytes=None, peak_rss_bytes=10**8,
                           step_times_s=(0.1,), init_s=3.5, init_peak_allocated_bytes=GIB // 2,
                           training_peak_allocated_bytes=GIB)
    result = TrialResult(outcome=Outcome.OK, ranks=(rank,), losses=(5.0, 4.5, 4.25), applied=(True, False, True),
                         step_time_s=0.125, tokens_per_s=2048.0, loss_fidelity=3e-5, wall_s=9.5,
                         device_name="NVIDIA H100 80GB HBM3", device_total_bytes=85_520_809_984)
    calls: list = []
    after: list = []
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    objective = _objective(tiny, calls, result, artifact_dir=lambda c: f"runs/{c.label()}", after_launch=after.append)
    # memory: training peak 2^30 + reserve 0 − host share 0 = 1,073,741,824 B; tokens/s as measured
    assert objective(trial) == (1_073_741_824.0, 2048.0)
    attrs = trial.user_attrs
    assert calls == [BASE_LABEL] and after == [trial]
    assert (attrs["label"], attrs["worker"], attrs["trial_dir"]) == (BASE_LABEL, "local", f"runs/{BASE_LABEL}")
    assert attrs["candidate"] == {"zero_stage": 0, "offload_optimizer": "none", "offload_param": "none",
                                  "precision": "fp32", "checkpointing": "none", "micro_batch_size": 2}
    assert attrs["memory_factor"] == 1.0  # nothing measured: the ledger's own figure (StudyModels.memory_factor)
    assert "MEMORY_FACTOR" not in attrs
    assert (attrs["outcome"], attrs["wall_s"], attrs["attempts"], attrs["launches"]) == ("ok", 9.5, 1, 1)
    assert attrs["device"] == {"name": "NVIDIA H100 80GB HBM3", "total_bytes": 85_520_809_984}
    assert (attrs["loss_fidelity"], attrs["tokens_per_s"], attrs["step_time_s"]) == (3e-5, 2048.0, 0.125)
    assert attrs["skipped_steps"] == 1 and attrs["losses"] == [5.0, 4.5, 4.25]  # one step not applied
    assert (attrs["peak_memory_bytes"], attrs["peak_reserved_bytes"], attrs["init_s"]) == (1_200_000_000, None, 3.5)
    assert (attrs["init_peak_memory_bytes"], attrs["init_peak_reserved_bytes"]) == (536_870_912, None)
    assert (attrs["training_peak_memory_bytes"], attrs["training_peak_reserved_bytes"]) == (1_073_741_824, None)
    assert attrs["device_share_bytes"] == attrs["memory_objective_bytes"] == 1_073_741_824
    assert attrs["init_device_share_bytes"] == 536_870_912
    assert attrs["init_memory_excess"] == -0.75  # (2^29 − 2^31) / 2^31
    assert "fidelity_unknown" not in attrs and "failed_attempts" not in attrs and "message" not in attrs
    assert trial.constraints["loss_fidelity"] == pytest.approx(-7e-5, abs=1e-15)  # 3e-5 − 1e-4 (fp32)
    assert trial.constraints["init_memory"] == -0.75


def test_a_launch_that_reported_no_memory_counts_zero_bytes(tiny):
    """No rank reported a peak: the device share is 0 (not 1), init 0 — (0 − 2^31) / 2^31 = −1 over capacity."""
    calls: list = []
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    assert _objective(tiny, calls, _ok(peak_allocated_bytes=None, peak_reserved_bytes=None))(trial) == (0.0, 1000.0)
    attrs = trial.user_attrs
    assert attrs["device_share_bytes"] == attrs["memory_objective_bytes"] == 0
    assert attrs["init_device_share_bytes"] == 0 and attrs["init_memory_excess"] == -1.0
    assert attrs["peak_memory_bytes"] is None and attrs["training_peak_memory_bytes"] is None
    assert trial.constraints["init_memory"] == -1.0


def test_the_calibrated_memory_factor_of_the_candidates_group_is_recorded(tiny):
    base = baseline_candidate(tiny.training)
    models = StudyModels(rates=Rates(seconds_per=(None,) * len(FEATURES), source="none"),
                         memory_factors=((memory_group(base), 1.25),), time_samples=0, measured_fits=frozenset())
    calls: list = []
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, tiny, base)
    _objective(tiny, calls, _ok(peak_allocated_bytes=1000, peak_reserved_bytes=None), models=lambda: models)(trial)
    assert trial.user_attrs["memory_factor"] == 1.25 and calls == [BASE_LABEL]


# --- retries --------------------------------------------------------------------------------------------------------

def test_a_crash_is_launched_once_more_and_the_failed_attempt_is_recorded(tiny):
    message = "x" * 100 + "y" * 300  # 400 characters: the record keeps the last 300
    calls: list = []
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    values = _objective(tiny, calls, _crash(message, 1.5), _ok(peak_allocated_bytes=2000, peak_reserved_bytes=None))(
        trial)
    assert values == (2000.0, 1000.0) and calls == [BASE_LABEL, BASE_LABEL]
    attrs = trial.user_attrs
    assert attrs["failed_attempts"] == [{"outcome": "crash", "message": "y" * 300, "wall_s": 1.5}]
    assert (attrs["launches"], attrs["attempts"], attrs["outcome"], attrs["wall_s"]) == (2, 2, "ok", 7.25)


def test_a_crash_that_repeats_stands_after_the_one_retry(tiny):
    calls: list = []
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    with pytest.raises(TrialFailed) as caught:
        _objective(tiny, calls, _crash("first", 1.0), _crash("second", 2.0))(trial)
    assert str(caught.value) == "crash: second" and calls == [BASE_LABEL, BASE_LABEL]
    attrs = trial.user_attrs
    assert attrs["failed_attempts"] == [{"outcome": "crash", "message": "first", "wall_s": 1.0}]
    assert (attrs["launches"], attrs["attempts"], attrs["outcome"], attrs["wall_s"]) == (2, 2, "crash", 2.0)
    assert attrs["message"] == "second" and "loss_fidelity" not in attrs


@pytest.mark.parametrize(("ranks", "launches"), [(0, 0), (1, 1)])
def test_an_invalid_result_counts_a_launch_only_when_a_rank_started(tiny, ranks, launches):
    """An op this node cannot build stops before any rank (no launch spent); invalid is never retried."""
    rank = RankMeasurement(rank=0, peak_allocated_bytes=None, peak_reserved_bytes=None, peak_rss_bytes=1,
                           step_times_s=())
    invalid = TrialResult(outcome=Outcome.INVALID, ranks=(rank,) * ranks, message="cannot build cpu_adam", wall_s=0.5)
    calls: list = []
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    with pytest.raises(TrialFailed) as caught:
        _objective(tiny, calls, invalid)(trial)
    assert str(caught.value) == "invalid: cannot build cpu_adam" and calls == [BASE_LABEL]
    attrs = trial.user_attrs
    assert (attrs["launches"], attrs["attempts"], attrs["outcome"], attrs["message"]) == (
        launches, 1, "invalid", "cannot build cpu_adam")


def test_an_ok_run_over_the_per_device_budget_is_an_oom(tiny):
    """Training measured 3 GiB = 3,221,225,472 B = 3221.225 MB on a 2 GiB = 2147.484 MB budget: 2^30 / 2^31 = 50.0 %
    over."""
    calls: list = []
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    with pytest.raises(TrialFailed) as caught:
        _objective(tiny, calls, _ok(peak_allocated_bytes=3 * GIB, peak_reserved_bytes=None))(trial)
    why = "measured training device share 3221.225 MB (10^6 bytes) exceeds the per-device budget 2147.484 MB by 50.0 %"
    assert str(caught.value) == "oom: " + why
    assert (trial.user_attrs["outcome"], trial.user_attrs["message"]) == ("oom", why)
    assert trial.user_attrs["device_share_bytes"] == 3 * GIB and trial.constraints == {}


# --- the budget -----------------------------------------------------------------------------------------------------

PAST = datetime(2000, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(("budget", "created_at", "reason"), [
    (BudgetSettings(max_launches=2), None,
     "2 of budget.max_launches=2 launches used (retries and the FP32 reference included)"),
    (BudgetSettings(deadline=PAST), None, "budget.deadline 2000-01-01T00:00:00+00:00 has passed"),
    (BudgetSettings(max_hours=1.5), "2000-01-01T00:00:00+00:00",
     "budget.max_hours=1.5 since the study was created (2000-01-01T00:00:00+00:00) have passed"),
])
def test_a_spent_budget_prunes_the_trial_before_any_launch(tiny, budget, created_at, reason):
    study = optuna.create_study(directions=list(DIRECTIONS))
    study.set_user_attr(REFERENCE_LAUNCHES_ATTR, 2)  # the FP32 reference took two launches
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    calls: list = []
    gate = LaunchGate(budget=budget, created_at=created_at, worker="w1")
    with pytest.raises(optuna.TrialPruned) as caught:
        _objective(tiny, calls, _ok(peak_allocated_bytes=1, peak_reserved_bytes=None), gate=gate)(trial)
    assert str(caught.value) == "budget spent: " + reason and calls == []
    attrs = trial.user_attrs
    assert attrs["budget_stop"] is True and attrs["pruned_reason"] == "budget spent: " + reason
    assert {"BUDGET_STOP", "XXbudget_stopXX", "XXpruned_reasonXX", "launch_claim", "launches"}.isdisjoint(attrs)


def test_a_budget_not_yet_spent_lets_the_trial_launch(tiny):
    future = datetime.now(UTC) + timedelta(days=365)
    budget = BudgetSettings(max_launches=3, deadline=future, max_hours=24.0)
    study = optuna.create_study(directions=list(DIRECTIONS))
    study.set_user_attr(REFERENCE_LAUNCHES_ATTR, 1)  # 1 used + this trial's 1 = 2 ≤ 3
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    calls: list = []
    gate = LaunchGate(budget=budget, created_at=datetime.now(UTC).isoformat(), worker="w1")
    assert _objective(tiny, calls, _ok(peak_allocated_bytes=5, peak_reserved_bytes=None), gate=gate)(trial) == (
        5.0, 1000.0)
    attrs = trial.user_attrs
    assert calls == [BASE_LABEL] and "budget_stop" not in attrs and "pruned_reason" not in attrs
    claim = attrs["launch_claim"]
    assert (claim["trial"], claim["key"], claim["worker"], claim["state"]) == (trial.number, BASE_LABEL, "w1",
                                                                               "claimed")
    assert attrs["worker"] == "w1"


def test_a_reference_launched_to_judge_the_trial_counts_as_a_launch(tiny):
    """A trial judged against the FP32 reference at its micro-batch size, launched for it (dropout), made two launches:
    ``--n-trials`` and ``budget.max_launches`` count both; a retry does not launch that reference again."""
    study = optuna.create_study(directions=list(DIRECTIONS))
    study.set_user_attr(REFERENCE_LAUNCHES_ATTR, 1)
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    calls: list = []
    judged_again = _ok(peak_allocated_bytes=5, peak_reserved_bytes=None)  # the reference is cached by then
    gate = LaunchGate(budget=BudgetSettings(), created_at=None, worker="w1")
    _objective(tiny, calls, replace(_crash(), reference_launches=1), judged_again, gate=gate)(trial)
    assert calls == [BASE_LABEL, BASE_LABEL]  # a crash, retried once (trial.retries: 1)
    assert trial.user_attrs["launches"] == 3 and trial.user_attrs["reference_launches"] == 1
    frozen = study.get_trials(deepcopy=False)
    assert launches_used(frozen, reference_launches=1) == 4


# --- reuse ----------------------------------------------------------------------------------------------------------

REUSED = {"outcome": "ok", "message": "all good", "loss_fidelity": 4e-5, "tokens_per_s": 1234.5,
          "peak_memory_bytes": 999_000, "trial_dir": "runs/earlier", "memory_objective_bytes": 888_000,
          "device_share_bytes": 777_000, "init_memory_excess": -0.625}
"""Every attribute a reuse copies, each with its own value."""


def test_a_reused_result_copies_every_measured_attribute_and_its_constraints(tiny):
    study = optuna.create_study(directions=list(DIRECTIONS))
    study.add_trial(optuna.trial.create_trial(values=[888_000.0, 1234.5],
                                              user_attrs={"label": BASE_LABEL, "step_time_s": 0.5, **REUSED}))
    calls: list = []
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    assert _objective(tiny, calls, _crash())(trial) == (888_000.0, 1234.5)
    attrs = trial.user_attrs
    assert calls == [] and attrs["reused_from"] == 0
    assert {name: attrs.get(name) for name in REUSED} == REUSED
    assert "step_time_s" not in attrs and "fidelity_unknown" not in attrs and "launches" not in attrs
    assert {"OUTCOME", "XXtokens_per_sXX"}.isdisjoint(attrs)
    assert trial.constraints["loss_fidelity"] == pytest.approx(-6e-5, abs=1e-15)  # 4e-5 − 1e-4 (fp32)
    assert trial.constraints["init_memory"] == -0.625


def test_a_reused_result_without_an_init_measurement_has_a_zero_init_constraint(tiny):
    """A trial recorded before the init phase was measured: its init constraint is 0 (feasible, at the edge)."""
    study = optuna.create_study(directions=list(DIRECTIONS))
    study.add_trial(optuna.trial.create_trial(values=[5.0, 6.0], user_attrs={"label": BASE_LABEL, "outcome": "ok",
                                                                             "loss_fidelity": 3e-4}))
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    assert _objective(tiny, [], _crash())(trial) == (5.0, 6.0)
    assert trial.constraints["init_memory"] == 0.0
    assert trial.constraints["loss_fidelity"] == pytest.approx(2e-4, abs=1e-15)  # 3e-4 − 1e-4: infeasible
    assert (trial.user_attrs["outcome"], trial.user_attrs["loss_fidelity"]) == ("ok", 3e-4)
    assert "init_memory_excess" not in trial.user_attrs


def test_a_reused_failure_fails_again_with_its_outcome(tiny):
    study = optuna.create_study(directions=list(DIRECTIONS))
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, user_attrs={
        "label": BASE_LABEL, "outcome": "oom", "message": "CUDA out of memory", "peak_memory_bytes": 3_000_000}))
    calls: list = []
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    with pytest.raises(TrialFailed) as caught:
        _objective(tiny, calls, _crash())(trial)
    assert str(caught.value) == "oom (as trial 0)" and calls == []
    attrs = trial.user_attrs
    assert (attrs["reused_from"], attrs["outcome"], attrs["message"]) == (0, "oom", "CUDA out of memory")
    assert attrs["peak_memory_bytes"] == 3_000_000 and "loss_fidelity" not in attrs
    assert trial.constraints == {}


# --- a risky candidate ----------------------------------------------------------------------------------------------

def _risky_spec(tiny):
    """tests/optimizer/search/test_launch_policy.py's spec: ZeRO-1/2, bf16, no checkpointing, formula activations,
    2,910,000 B."""
    space = SearchSpace(values=(("zero_stage", (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS)),
                                ("precision", (Precision.BF16,)), ("checkpointing", (parse_checkpointing("none"),)),
                                ("micro_batch_size", (1, 2, 4))), source="test")
    return replace(tiny, model=replace(tiny.model, activations=ActivationSource.FORMULA), search_space=space,
                   hardware=replace(tiny.hardware, gpu_memory_bytes=2_910_000))


def _risky_candidate(spec):
    return next(c for c in spec.search_space.candidates(baseline_candidate(spec.training)) if c.label() == RISKY)


def test_the_samplers_proposal_of_a_risky_candidate_is_held_with_the_policys_reason(tiny):
    spec = _risky_spec(tiny)
    calls: list = []
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, spec, _risky_candidate(spec))
    with pytest.raises(optuna.TrialPruned) as caught:
        _objective(spec, calls, _crash())(trial)
    reason = "held: needs 98.0 % of the budget, margin 0.495 MB; probability to fit 59%" + HELD_TAIL
    attrs = trial.user_attrs
    assert attrs["pruned_reason"] == reason == str(caught.value) and calls == []
    assert attrs["held"] is True and attrs["launch_margin_bytes"] == 495_171
    assert attrs["fit_probability"] == pytest.approx(0.5921, abs=1e-4) and attrs["memory_factor"] == 1.0
    assert "launches" not in attrs and "launch_claim" not in attrs and "ledger" not in attrs


def test_the_launch_policys_choice_of_a_risky_candidate_is_launched(tiny):
    spec = _risky_spec(tiny)
    calls: list = []
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, spec, _risky_candidate(spec), enqueued_by="model: best expected gain")
    values = _objective(spec, calls, _ok(peak_allocated_bytes=2_000_000, peak_reserved_bytes=None))(trial)
    assert values == (2_000_000.0, 1000.0) and calls == [RISKY]
    assert "held" not in trial.user_attrs and trial.user_attrs["launches"] == 1


# --- open_study -----------------------------------------------------------------------------------------------------

def test_open_study_uses_the_sampler_it_is_given(tiny, tmp_path):
    sampler = optuna.samplers.RandomSampler(seed=7)
    study = open_study(spec=tiny, storage=f"journal://{tmp_path}/study.log", sampler=sampler)
    assert study.sampler is sampler
    assert study.study_name == "cpu-tiny"


# --- the setup lease ------------------------------------------------------------------------------------------------

def _lease(study, worker: str, now: list[float], sleeps: list[float]) -> SetupLease:
    return SetupLease(study, key="k", worker=worker, clock=lambda: now[0], sleep=sleeps.append)


def test_a_worker_takes_again_a_fresh_lease_in_its_own_name():
    """A worker restarted under the same name (host:pid/array task) finds its own lease, 10 s old: not another's,
    so it renews it and proceeds."""
    study = optuna.create_study(directions=list(DIRECTIONS))
    study.set_user_attr("dsopt_setup", {"key": "k", "worker": "a", "at": 100.0})
    now, sleeps = [110.0], []
    lease = _lease(study, "a", now, sleeps)
    assert lease.acquire() is True
    assert study.user_attrs["dsopt_setup"] == {"key": "k", "worker": "a", "at": 110.0}
    assert sleeps == [1.0]  # SETTLE_S between writing and reading back


@pytest.mark.parametrize(("lease", "taken"), [
    ({"key": "k", "worker": "b", "at": 20.0}, False),  # 100 − 20 = 80 s < 90 s: b is alive
    ({"key": "k", "worker": "b", "at": 10.0}, True),  # 100 − 10 = 90 s, not < LEASE_STALE_S = 90: stale
    ({"key": "old", "worker": "b", "at": 99.0}, True),  # b set up another study file: not this key's lease
    ({"key": "k", "worker": "b"}, True),  # no time written: read as 0, 100 s old
    ("k", True),  # not a lease at all
])
def test_another_workers_lease_blocks_only_while_fresh_and_for_this_key(lease, taken):
    study = optuna.create_study(directions=list(DIRECTIONS))
    study.set_user_attr("dsopt_setup", lease)
    now, sleeps = [100.0], []
    assert _lease(study, "a", now, sleeps).acquire() is taken
    expected = {"key": "k", "worker": "a", "at": 100.0} if taken else lease
    assert study.user_attrs["dsopt_setup"] == expected and sleeps == ([1.0] if taken else [])
