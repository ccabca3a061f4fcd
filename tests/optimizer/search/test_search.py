"""The Optuna glue without launches: DeepSpeed-valid branches, enqueue parameters, picks, redaction."""

from __future__ import annotations

import optuna
import pytest

from optimizer.ledger.core import evaluate
from optimizer.results.pareto import feasible_front, pick_trial
from optimizer.results.trial_result import Outcome, RankMeasurement, TrialResult
from optimizer.search.objective import DIRECTIONS, TrialFailed, make_objective
from optimizer.search.space import branches, distribution_params, sample_candidate
from optimizer.search.storage import connection_url, redact
from optimizer.study.errors import UserError
from optimizer.study.knobs import OffloadDevice, ZeroStage
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study


@pytest.fixture
def demo(repo_root):
    return load_study(repo_root / "studies" / "demo-cpu.yaml")


def test_branches_follow_deepspeeds_rules(demo):
    space = branches(demo)
    assert space.offload_optimizer[ZeroStage.DISABLED] == (OffloadDevice.NONE,)
    assert space.offload_optimizer[ZeroStage.GRADIENTS] == (OffloadDevice.NONE, OffloadDevice.CPU)
    assert space.offload_param == (OffloadDevice.NONE, OffloadDevice.CPU)
    assert space.precision == ("fp32", "bf16")  # fp16 is not in the CPU ranks' supported precisions


def test_every_valid_candidate_is_reachable_and_enqueue_params_round_trip(demo):
    space = branches(demo)
    base = baseline_candidate(demo.training)
    seen = 0
    for candidate in demo.search_space.candidates(base):
        if evaluate(candidate=candidate, model=demo.model, hardware=demo.hardware, training=demo.training).ledger:
            params = distribution_params(candidate, space)
            assert sample_candidate(optuna.trial.FixedTrial(params), space, base) == candidate
            seen += 1
    assert seen == 216


def test_candidate_label_is_stable(demo):
    # demo-cpu.yaml trains at micro-batch 2: the baseline is ZeRO-0, fp32, no recomputation (docs/studies.md)
    assert baseline_candidate(demo.training).label() == "z0 fp32 ckpt=none mbs=2"


def _trial(number_values, fidelity, key):
    return optuna.trial.create_trial(values=list(number_values), user_attrs={"label": key,
                                                                               "loss_fidelity": fidelity},
                                     system_attrs={"constraints:loss_fidelity": fidelity - 0.01})


def test_picks_on_the_feasible_front():
    study = optuna.create_study(directions=["minimize", "maximize"])
    study.add_trial(_trial((1.0, 10.0), 0.0, "a"))
    study.add_trial(_trial((2.0, 40.0), 0.0, "b"))
    study.add_trial(_trial((4.0, 50.0), 0.0, "c"))
    study.add_trial(_trial((0.5, 100.0), 0.5, "d"))  # dominates all, but infeasible (fidelity out of tolerance)
    study.add_trial(_trial((2.0, 40.0), 0.0, "b"))  # a reused copy of b
    assert [t.user_attrs["label"] for t in feasible_front(study)] == ["a", "b", "c"]
    assert pick_trial(study, "fastest").user_attrs["label"] == "c"
    assert pick_trial(study, "smallest").user_attrs["label"] == "a"
    assert pick_trial(study, "balanced").user_attrs["label"] == "b"
    assert pick_trial(study, "trial=2").number == 2
    with pytest.raises(UserError, match="violates"):
        pick_trial(study, "trial=3")
    with pytest.raises(UserError, match="expected one of"):
        pick_trial(study, "cheapest")


def test_passwords_are_masked():
    assert redact("postgresql+psycopg://dsopt:s3cret@db.example:5432/x") == "postgresql+psycopg://dsopt:***@db.example:5432/x"
    assert redact("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


@pytest.mark.parametrize("password", ["p@ss", "a:b@c/d", "@@", "x y", "100%", "p%40ss", "/:@?#"])
def test_any_password_is_masked_by_parsing_and_connects_as_written(password):
    url = f"postgresql://alice:{password}@db.example:5432/studies"
    assert redact(url) == "postgresql://alice:***@db.example:5432/studies"
    message = f"cannot reach {url}; the server said: password {password} was refused"
    assert password not in redact(message, url=url)
    # What SQLAlchemy is given parses back to the password as typed ('@' encoded; its pattern stops at '@').
    from sqlalchemy.engine import make_url

    parsed = make_url(connection_url(url))
    # a '%xx' the user wrote stays theirs to mean: SQLAlchemy decodes it ('p%40ss' is p@ss; '100%' stays as typed)
    meant = {"p%40ss": "p@ss"}.get(password, password)
    assert (parsed.password, parsed.host, parsed.port, parsed.database) == (meant, "db.example", 5432, "studies")


def _ok() -> TrialResult:
    rank = RankMeasurement(rank=0, peak_allocated_bytes=1_000_000, peak_reserved_bytes=None, peak_rss_bytes=10**8,
                           step_times_s=(0.1,), training_peak_allocated_bytes=900_000,
                           init_peak_allocated_bytes=400_000)
    return TrialResult(outcome=Outcome.OK, ranks=(rank,), losses=(5.0,), step_time_s=0.1, tokens_per_s=1000.0,
                       loss_fidelity=0.0)


def _run_twice(spec, outcomes):
    """The same candidate sampled twice; the runner answers ``outcomes`` in turn."""
    calls = []

    def runner(candidate):
        calls.append(candidate)
        outcome = outcomes[len(calls) - 1]
        return _ok() if outcome is Outcome.OK else TrialResult(outcome=outcome, message=f"{outcome} #{len(calls)}")

    space = branches(spec)
    study = optuna.create_study(directions=list(DIRECTIONS))
    for _ in range(2):
        study.enqueue_trial(distribution_params(baseline_candidate(spec.training), space))
    study.optimize(make_objective(spec=spec, space=space, runner=runner), n_trials=2, catch=(TrialFailed,))
    return study.get_trials(), calls


def test_a_transient_crash_is_launched_again_once_then_the_result_is_reused(repo_root):
    spec = load_study(repo_root / "studies" / "cpu-tiny.yaml")
    assert spec.trial.retries == 1
    trials, calls = _run_twice(spec, [Outcome.CRASH, Outcome.OK])
    assert len(calls) == 2  # the crash, then the retry; the second trial reuses the first
    first, second = trials
    assert first.state is optuna.trial.TrialState.COMPLETE and first.user_attrs["attempts"] == 2
    assert first.user_attrs["failed_attempts"][0]["outcome"] == "crash"
    assert first.values[0] == 900_000  # the memory objective is training's peak (+ the reserve, 0 here)
    assert second.user_attrs["reused_from"] == first.number


@pytest.mark.parametrize("outcome", [Outcome.TIMEOUT, Outcome.OOM])
def test_a_failure_that_stands_is_reused(repo_root, outcome):
    spec = load_study(repo_root / "studies" / "cpu-tiny.yaml")
    trials, calls = _run_twice(spec, [outcome] * 4)
    assert len(calls) == (2 if outcome is Outcome.TIMEOUT else 1)  # an OOM is the candidate's: never retried
    assert all(t.state is optuna.trial.TrialState.FAIL for t in trials)
    assert trials[0].user_attrs["outcome"] == outcome.value and trials[1].user_attrs["reused_from"] == 0


def _measured(training_bytes: int) -> TrialResult:
    rank = RankMeasurement(rank=0, peak_allocated_bytes=training_bytes, peak_reserved_bytes=None,
                           peak_rss_bytes=10**8, step_times_s=(0.1,), training_peak_allocated_bytes=training_bytes,
                           init_peak_allocated_bytes=1000)
    return TrialResult(outcome=Outcome.OK, ranks=(rank,), losses=(5.0,), step_time_s=0.1, tokens_per_s=1000.0,
                       loss_fidelity=0.0)


def test_a_run_measured_over_the_budget_is_an_oom_kept_as_data(repo_root):
    """On CPU ranks nothing runs out of memory at the budget: the study applies it. One byte over is ``oom``
    (FAIL, never on the front, reused, its memory and time fed to calibration); exactly the budget fits."""
    from dataclasses import replace

    from optimizer.search.ordering import memory_group, study_models

    spec = load_study(repo_root / "studies" / "cpu-tiny.yaml")
    base = baseline_candidate(spec.training)
    other = replace(base, zero_stage=ZeroStage.OPTIMIZER)
    need = evaluate(candidate=base, model=spec.model, hardware=spec.hardware, training=spec.training).ledger
    budget = 4 * need.training_needed_bytes  # far below: no launch rule holds either candidate back
    spec = replace(spec, hardware=replace(spec.hardware, gpu_memory_bytes=budget))
    over = budget + 12_345
    answers = {base.label(): over, other.label(): budget}
    calls = []

    def runner(candidate):
        calls.append(candidate)
        return _measured(answers[candidate.label()])

    space = branches(spec)
    study = optuna.create_study(directions=list(DIRECTIONS))
    for candidate in (base, base, other):
        study.enqueue_trial(distribution_params(candidate, space))
    study.optimize(make_objective(spec=spec, space=space, runner=runner), n_trials=3, catch=(TrialFailed,))
    first, again, fits = study.get_trials()
    assert len(calls) == 2  # the over-budget candidate is not launched again
    assert first.state is optuna.trial.TrialState.FAIL and first.user_attrs["outcome"] == "oom"
    assert "exceeds the per-device budget" in first.user_attrs["message"]
    assert first.user_attrs["device_share_bytes"] == over
    assert again.state is optuna.trial.TrialState.FAIL and again.user_attrs["reused_from"] == first.number
    assert fits.state is optuna.trial.TrialState.COMPLETE and fits.values[0] == budget
    assert [t.number for t in feasible_front(study)] == [fits.number]
    models = study_models(spec=spec, trials=study.get_trials(), base=base)
    assert models.memory_factor(base) == pytest.approx(over / first.user_attrs["predicted_training_needed_bytes"])
    assert memory_group(base) != memory_group(other) and models.time_samples == 2


def test_once_calibrated_a_safe_candidate_the_time_model_cannot_predict_goes_first(repo_root):
    """Unknown speed (no figure: CPU ranks have no profile) is tried first while nothing is predictable (the promise
    order) and once the model is calibrated (one launch teaches it the missing figure); a predictable candidate is
    ranked by the value of its launch (tier 1)."""
    from optimizer.perf.throughput import profile_rates
    from optimizer.search.next_launch import options
    from optimizer.search.ordering import StudyModels

    def tier(spec, samples):
        base = baseline_candidate(spec.training)
        verdicts = [evaluate(candidate=c, model=spec.model, hardware=spec.hardware, training=spec.training)
                    for c in spec.search_space.candidates(base)]
        models = StudyModels(rates=profile_rates(hardware=spec.hardware), memory_factors=(), time_samples=samples,
                             measured_fits=frozenset())
        ranked = options(spec=spec, space=branches(spec), trials=[], models=models, verdicts=verdicts)
        safe = {(o.order[0], o.tokens_per_s is None) for o in ranked if o.assessment.standing.value == "safe"}
        assert ranked and len(safe) == 1, safe
        return safe.pop()

    cpu = load_study(repo_root / "studies" / "cpu-tiny.yaml")  # no profile figures: unknown
    gpu = load_study(repo_root / "studies" / "llama-7b-8xh100.yaml")  # the H100 profile: predicted
    assert tier(gpu, 0) == (1, False) and tier(gpu, 3) == (1, False)  # predictable: by value
    assert tier(cpu, 0) == (0, True) and tier(cpu, 3) == (0, True)  # unknown and safe: first


def test_a_password_equal_to_the_user_name_masks_only_the_password():
    url = "postgresql+psycopg://dsopt:dsopt@127.0.0.1:5432/dsopt"
    assert redact(url) == "postgresql+psycopg://dsopt:***@127.0.0.1:5432/dsopt"
    masked = "postgresql+psycopg://dsopt:***@127.0.0.1:5432/dsopt"
    assert redact(f"storage: {url} (3 workers)") == f"storage: {masked} (3 workers)"
