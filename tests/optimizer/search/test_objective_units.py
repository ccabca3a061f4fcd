"""The objective's branches one at a time (optimizer/search/objective.py), with a fake runner and no launch.

Figures, each worked by hand:

* cpu-tiny (studies/cpu-tiny.yaml): a 2-layer GPT, h = 64, vocab 256, 64 positions, tied embeddings, on 2 CPU
  ranks. Parameters: 256·64 = 16,384 (embedding, tied) + 64·64 = 4,096 (positions) + 2 blocks × 49,984
  (LayerNorms 2·128 = 256, QKV 64·192 + 192 = 12,480, out 64·64 + 64 = 4,160, MLP 64·256 + 256 = 16,640 and
  256·64 + 64 = 16,448) + final LayerNorm 128 = 120,576. The study states no device reserve (0 on CPU ranks).
* ZeRO-1 + CPU optimizer offload, fp32, 2 ranks: each rank's partition is 120,576 / 2 = 60,288 parameters. On the
  host (DeepSpeed runtime/zero/stage_1_and_2.py, cpu_offload): fp32 master partition 60,288·4 = 241,152, Adam
  exp_avg + exp_avg_sq 60,288·8 = 482,304, fp32 gradient partition 241,152, fp32 parameter staging partition
  241,152, temp_grad_buffer_for_cpu_offload of the largest parameter (the embedding, 16,384 elements)·4 = 65,536:
  1,271,296 bytes in training; at init the master, gradient and staging partitions: 3·241,152 = 723,456 bytes.
* The seed study (studies/seed-1b-2x24gb.yaml): plain data parallel needs 26 GB per GPU (the seed document, Q130;
  tests/optimizer/ledger/test_seed_ledger.py), no reserve, no allocator overhead.
"""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest

from optimizer.results.trial_result import Outcome, RankMeasurement, TrialResult
from optimizer.search.coordination import Pause
from optimizer.search.objective import DIRECTIONS, LaunchGate, TrialFailed, make_objective, open_study, over_budget
from optimizer.search.objective import seed_study as seed_the_study
from optimizer.search.space import branches, distribution_params, sample_candidate
from optimizer.study.errors import UserError
from optimizer.study.knobs import OffloadDevice, ZeroStage
from optimizer.study.machine_probe import MachineProbe, ProbeFigure
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

BASE_LABEL = "z0 fp32 ckpt=none mbs=2"  # cpu-tiny's baseline (tests/optimizer/search/test_search.py, docs/studies.md)


@pytest.fixture(autouse=True)
def _quiet():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def _rank(*, training: int, init: int, peak: int | None = None) -> RankMeasurement:
    return RankMeasurement(rank=0, peak_allocated_bytes=training if peak is None else peak, peak_reserved_bytes=None,
                           peak_rss_bytes=10**8, step_times_s=(0.1,), training_peak_allocated_bytes=training,
                           init_peak_allocated_bytes=init)


def _ok(*, training: int, init: int, fidelity: float | None = 0.0) -> TrialResult:
    return TrialResult(outcome=Outcome.OK, ranks=(_rank(training=training, init=init),), losses=(5.0,),
                       step_time_s=0.1, tokens_per_s=1000.0, loss_fidelity=fidelity, wall_s=7.25)


def _asked(study: optuna.Study, spec, candidate, **user_attrs) -> optuna.Trial:
    """A running trial that samples ``candidate`` (enqueued, then asked)."""
    study.enqueue_trial(distribution_params(candidate, branches(spec)), user_attrs=user_attrs or None)
    return study.ask()


def _objective(spec, calls: list, answer, **kwargs):
    def runner(candidate):
        calls.append(candidate.label())
        return answer

    return make_objective(spec=spec, space=branches(spec), runner=runner, **kwargs)


# --- over_budget ----------------------------------------------------------------------------------------------------

def test_over_budget_names_the_phase_the_share_and_the_excess():
    # 1,500,000 B = 1.500 MB against 1,000,000 B = 1.000 MB: 100·500,000/1,000,000 = 50.0 % over
    assert over_budget(training_bytes=1_500_000, init_bytes=0, budget_bytes=1_000_000) == (
        "measured training device share 1.500 MB (10^6 bytes) exceeds the per-device budget 1.000 MB by 50.0 %")
    # training fits exactly; init 1,250,000 B is 25.0 % over
    assert over_budget(training_bytes=1_000_000, init_bytes=1_250_000, budget_bytes=1_000_000) == (
        "measured init device share 1.250 MB (10^6 bytes) exceeds the per-device budget 1.000 MB by 25.0 %")
    assert over_budget(training_bytes=1_000_000, init_bytes=1_000_000, budget_bytes=1_000_000) == ""


# --- open_study -----------------------------------------------------------------------------------------------------

def test_open_study_creates_a_two_objective_study_with_named_axes(tiny, tmp_path):
    study = open_study(spec=tiny, storage=f"journal://{tmp_path}/study.log")
    assert study.directions == [optuna.study.StudyDirection.MINIMIZE, optuna.study.StudyDirection.MAXIMIZE]
    assert study.metric_names == ["training memory per device (bytes)", "tokens/s"]


def test_a_same_named_single_objective_study_is_a_user_error_naming_the_storage(tiny, tmp_path):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    url = f"journal://{tmp_path}/study.log"
    journal = JournalStorage(JournalFileBackend(f"{tmp_path}/study.log"))
    optuna.create_study(study_name=tiny.name, storage=journal, direction="minimize")  # one objective, not two
    with pytest.raises(UserError) as caught:
        open_study(spec=tiny, storage=url)
    assert caught.value.source == "--storage" and caught.value.key == url  # no password: shown as written
    assert caught.value.why.startswith("cannot open the study storage: ValueError: ")


# --- seed_study -----------------------------------------------------------------------------------------------------

def test_seeding_enqueues_one_safe_candidate_per_stage_lowest_first_and_only_once(tiny):
    space = branches(tiny)
    study = optuna.create_study(directions=list(DIRECTIONS))
    assert seed_the_study(study, tiny, space) == 3  # SEED_ENQUEUE: stages 0, 1 and 2 (all fit 2 GiB)
    assert study.user_attrs["dsopt_seeded"] is True
    assert seed_the_study(study, tiny, space) == 0  # seeded already: nothing more
    assert len(study.get_trials()) == 3
    assert all(t.user_attrs == {"enqueued_by": "seed"} for t in study.get_trials())
    base = baseline_candidate(tiny.training)
    stages = [sample_candidate(study.ask(), space, base).zero_stage for _ in range(3)]
    assert stages == [ZeroStage.DISABLED, ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS]


@pytest.mark.parametrize(("training", "state", "outcome"),
                         [(900_000, optuna.trial.TrialState.COMPLETE, None),
                          (1_100_000, optuna.trial.TrialState.FAIL, "oom")])
def test_a_measured_result_is_seen_as_the_study_will_record_it(tiny, training, state, outcome):
    # what the seeds know of the FP32 reference run: the objective's own record of it on a scratch study — at a 1 MB
    # budget 0.9 MB fits (values: the device share and tokens/s), 1.1 MB is an oom; no launch either way
    from optimizer.search.objective import measured_as_trials
    spec = replace(tiny, hardware=replace(tiny.hardware, gpu_memory_bytes=1_000_000))
    base = baseline_candidate(spec.training)
    [trial] = measured_as_trials(spec=spec, space=branches(spec), measured=[(base, _ok(training=training,
                                                                                       init=500_000))])
    assert trial.state is state and trial.user_attrs["label"] == BASE_LABEL
    assert trial.user_attrs["launches"] == 0 and trial.user_attrs["device_share_bytes"] == training
    assert trial.user_attrs.get("outcome") == (outcome or "ok")
    if outcome is None:
        assert trial.values == [900_000.0, 1000.0]
    assert measured_as_trials(spec=spec, space=branches(spec), measured=[]) == []


def test_the_seeds_are_chosen_knowing_the_reference_runs_measurement(tiny):
    # the reference's candidate is measured (it is the first seed without it): it is no seed; the seeds are the
    # first safe ones of the launch order with its trial known — its family's ledger error measured, its speed the
    # front to beat
    from optimizer.ledger.core import evaluate
    from optimizer.search.next_launch import options
    from optimizer.search.objective import measured_as_trials
    from optimizer.search.ordering import study_models
    space = branches(tiny)
    base = baseline_candidate(tiny.training)
    plain = optuna.create_study(directions=list(DIRECTIONS))
    seed_the_study(plain, tiny, space)
    first = sample_candidate(plain.ask(), space, base)
    measured = [(first, _ok(training=400_000, init=200_000))]
    study = optuna.create_study(directions=list(DIRECTIONS))
    assert seed_the_study(study, tiny, space, measured=measured) == 3
    seeds = [sample_candidate(study.ask(), space, base) for _ in range(3)]
    assert first not in seeds
    known = measured_as_trials(spec=tiny, space=space, measured=measured)
    verdicts = [evaluate(candidate=c, model=tiny.model, hardware=tiny.hardware, training=tiny.training)
                for c in tiny.search_space.candidates(base)]
    ranked = options(spec=tiny, space=space, trials=known, verdicts=verdicts,
                     models=study_models(spec=tiny, trials=known, base=base))
    safe = [o.candidate for o in ranked if o.assessment.standing.name == "SAFE"]
    stages = {}
    for candidate in safe:  # tiny has no probe: one seed per stage, the lowest stages first
        stages.setdefault(candidate.zero_stage, candidate)
    assert seeds == [stages[stage] for stage in sorted(stages)][:3]


def _probed(spec, *, engine_s: dict[int, float]):
    """``spec`` with a probe of its machine written by hand: every kernel figure the CPU time model needs, and
    DeepSpeed's engine per micro-step at the stages of ``engine_s`` (seconds; the optimizer step as dear again)."""
    def fig(kind, seconds, work, **kw):
        return ProbeFigure(kind=kind, work=work, median_s=seconds, low_s=seconds, high_s=seconds, repeats=5, **kw)

    figures = [fig(kind, 1e-3 * b, 1e8 * b, precision=p, micro_batch=b) for kind in ("gemm", "attention")
               for p in ("fp32", "bf16") for b in (1, 2, 4)]
    figures += [fig("all_reduce", 1e-3, 8192.0, variant="8192 B"), fig("all_reduce", 2e-2, 16e6, variant="16 MB"),
                fig("all_gather", 1e-3, 8192.0, variant="8192 B"), fig("all_gather", 1e-2, 16e6, variant="16 MB"),
                fig("host_adam", 1e-4, 6e4), fig("copy", 1e-5, 1e5, variant="host")]
    for stage, seconds in engine_s.items():
        figures += [fig("engine_micro", seconds, 1, precision="bf16", variant=f"z{stage}"),
                    fig("engine_step", 2 * seconds, 1, precision="bf16", variant=f"z{stage}")]
    probe = MachineProbe(machine="m", measured_at="2026-12-06T00:00:00+00:00", ranks=2, seconds=1.0,
                         figures=tuple(figures))
    return replace(spec, hardware=replace(spec.hardware, probe=probe))


def test_with_every_stages_engine_probed_the_seeds_follow_the_time_model_not_the_stages(tiny):
    # ZeRO-3's engine timed 100× cheaper than the others': the model's fastest candidates are ZeRO-3 ones, and the
    # seeds are the launch order's first three, whatever their stage (without the engine: one per stage, z0 first)
    base = baseline_candidate(tiny.training)
    for engine_s, first_stages in (({0: 0.1, 1: 0.1, 2: 0.1, 3: 0.001}, {ZeroStage.PARAMETERS}),
                                   ({0: 0.1, 1: 0.1, 2: 0.1}, {ZeroStage.DISABLED})):
        spec = _probed(tiny, engine_s=engine_s)
        study = optuna.create_study(directions=list(DIRECTIONS))
        assert seed_the_study(study, spec, branches(spec)) == 3
        stages = [sample_candidate(study.ask(), branches(spec), base).zero_stage for _ in range(3)]
        assert stages[0] in first_stages
    assert set(stages) == {ZeroStage.DISABLED, ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS}  # a stage not probed


def test_with_the_engine_probed_a_seed_may_be_risky_down_to_the_seed_probability(tiny):
    # over budgets from roomy to tight: the seeds are the launch order's first three with a probability to fit
    # ≥ SEED_FIT_PROBABILITY, in that order; a risky one carries the launch policy's mark (launched, not held), a
    # safe one the seed mark; a likelier-to-OOM candidate ahead of them in the launch order is passed over
    from optimizer.ledger.core import evaluate
    from optimizer.search.launch_policy import Standing
    from optimizer.search.next_launch import options
    from optimizer.search.objective import RISKY_SEED_MARK, SEED_FIT_PROBABILITY, SEED_MARK
    from optimizer.search.ordering import study_models
    base = baseline_candidate(tiny.training)
    risky_seeds = passed_over = 0
    for budget in range(1_000_000, 3_000_001, 100_000):
        spec = _probed(replace(tiny, hardware=replace(tiny.hardware, gpu_memory_bytes=budget)),
                       engine_s={0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1})
        space = branches(spec)
        verdicts = [evaluate(candidate=c, model=spec.model, hardware=spec.hardware, training=spec.training)
                    for c in spec.search_space.candidates(base)]
        ranked = options(spec=spec, space=space, trials=[], verdicts=verdicts,
                         models=study_models(spec=spec, trials=[], base=base))
        likely = [o for o in ranked if o.assessment.fit_probability >= SEED_FIT_PROBABILITY][:3]
        study = optuna.create_study(directions=list(DIRECTIONS))
        assert seed_the_study(study, spec, space) == len(likely)
        queued = study.get_trials()
        assert [sample_candidate(study.ask(), space, base) for _ in likely] == [o.candidate for o in likely]
        assert [t.user_attrs["enqueued_by"] for t in queued] == [
            SEED_MARK if o.assessment.standing is Standing.SAFE else RISKY_SEED_MARK for o in likely]
        risky_seeds += sum(o.assessment.standing is Standing.RISKY for o in likely)
        passed_over += bool(likely) and ranked.index(likely[-1]) >= len(likely)
    assert risky_seeds and passed_over  # both cases met somewhere in the range


def test_seeding_again_enqueues_no_duplicate(tiny):
    space = branches(tiny)
    study = optuna.create_study(directions=list(DIRECTIONS))
    seed_the_study(study, tiny, space)
    study.set_user_attr("dsopt_seeded", False)  # as if the guard were lost: the same three are not enqueued twice
    assert seed_the_study(study, tiny, space) == 3
    assert len(study.get_trials()) == 3


# --- make_objective: before any launch -----------------------------------------------------------------------------

def test_an_invalid_candidate_is_pruned_with_its_reasons(tiny):
    # a space that kept micro-batch 3: 3 × 2 ranks = 6 does not divide the global batch of 8
    space = replace(branches(tiny), micro_batch_size=(3,))
    objective = make_objective(spec=tiny, space=space, runner=lambda c: pytest.fail("launched"))
    trial = optuna.trial.FixedTrial(distribution_params(baseline_candidate(tiny.training), space))
    with pytest.raises(optuna.TrialPruned):
        objective(trial)
    assert trial.user_attrs["pruned_reason"] == (
        "invalid: micro_batch_size=3 x 2 ranks = 6 does not divide global_batch_size=8")


def test_a_candidate_predicted_not_to_fit_is_pruned_with_the_policys_reason(tiny):
    spec = replace(tiny, hardware=replace(tiny.hardware, gpu_memory_bytes=1_000_000))  # 1 MB: far too small
    calls: list = []
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, spec, baseline_candidate(spec.training))
    with pytest.raises(optuna.TrialPruned) as caught:
        _objective(spec, calls, None)(trial)
    reason = trial.user_attrs["pruned_reason"]
    assert reason.startswith("does not fit: ") and reason == str(caught.value)
    assert "ledger" in trial.user_attrs and calls == []


@pytest.mark.parametrize(("training", "outcome"), [(900_000, None), (1_100_000, "oom")])
def test_a_candidate_the_reference_run_measured_is_recorded_with_no_launch_whatever_the_prediction(
        tiny, training, outcome):
    # 1 MB: the ledger prunes the baseline (the test above); the FP32 reference run measured it all the same, so its
    # measurement is recorded, as any launch's is judged: 0.9 MB fits, 1.1 MB is over the budget (an oom), and
    # neither is a launch (the reference's own launch is counted as the reference's).
    spec = replace(tiny, hardware=replace(tiny.hardware, gpu_memory_bytes=1_000_000))
    base = baseline_candidate(spec.training)
    calls: list = []
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, spec, base)
    objective = _objective(spec, calls, None, measured=lambda c: _ok(training=training, init=500_000)
                           if c == base else None)
    if outcome is None:
        assert objective(trial) == (900_000.0, 1000.0)
    else:
        with pytest.raises(TrialFailed):
            objective(trial)
        assert trial.user_attrs["outcome"] == outcome
    assert calls == [] and trial.user_attrs["launches"] == 0
    assert trial.user_attrs["measured_by"] == "the FP32 reference run"
    assert "pruned_reason" not in trial.user_attrs and "fit_probability" not in trial.user_attrs


class _Stop(Exception):
    """Raised by the models callable: the objective got past its predictions."""


def test_the_prediction_recorded_is_the_seed_tables_figure(seed_study_path):
    seed = load_study(seed_study_path)
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, seed, baseline_candidate(seed.training))  # plain data parallel, fp32

    def models():
        raise _Stop

    with pytest.raises(_Stop):
        _objective(seed, [], None, models=models)(trial)
    attrs = trial.user_attrs
    assert attrs["predicted_bytes"] == 26 * 10**9  # 4 + 4 + 8 + 8 + 2 GB (the seed's table)
    assert attrs["predicted_training_needed_bytes"] == 26 * 10**9  # no overhead, no reserve stated
    assert attrs["predicted_host_bytes"] == 0 and attrs["predicted_init_host_bytes"] == 0  # GPUs: host measured apart


# --- make_objective: reuse ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fidelity", "unknown", "constraint"), [(None, True, 1.0), (0.0, False, None)])
def test_a_measured_candidate_is_reused_and_an_unknown_fidelity_stays_unknown(tiny, fidelity, unknown, constraint):
    study = optuna.create_study(directions=list(DIRECTIONS))
    study.add_trial(optuna.trial.create_trial(
        values=[1_234_567.0, 89.0], user_attrs={"label": BASE_LABEL, "loss_fidelity": fidelity, "outcome": "ok",
                                                "init_memory_excess": -0.5}))
    calls: list = []
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    assert _objective(tiny, calls, None)(trial) == (1_234_567.0, 89.0)
    assert calls == [] and trial.user_attrs["reused_from"] == 0
    assert ("fidelity_unknown" in trial.user_attrs) is unknown
    assert trial.constraints["init_memory"] == -0.5
    if constraint is not None:
        assert trial.constraints["loss_fidelity"] == constraint  # UNKNOWN_FIDELITY: violated


def test_a_worker_waiting_on_the_same_candidate_reuses_its_result(tiny):
    """Another worker holds the claim on the candidate (running); while this one pauses it finishes: its values
    are this trial's, and nothing is launched."""
    study = optuna.create_study(directions=list(DIRECTIONS))
    other = study.ask()
    other.set_user_attr("label", BASE_LABEL)
    other.set_user_attr("launch_claim", {"trial": other.number, "key": BASE_LABEL, "worker": "w2",
                                         "state": "claimed"})
    pauses: list = []
    stale_checks: list = []

    def sleep(_seconds):
        pauses.append(_seconds)
        other.set_user_attr("outcome", "ok")
        other.set_user_attr("loss_fidelity", 0.0)
        study.tell(other, [2_000_000.0, 800.0])

    gate = LaunchGate(worker="w1", pause=Pause(sleep=sleep), fail_stale=stale_checks.append)
    calls: list = []
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    assert _objective(tiny, calls, _ok(training=1, init=1), gate=gate)(trial) == (2_000_000.0, 800.0)
    assert calls == [] and len(pauses) == 1 and stale_checks == [study]
    assert trial.user_attrs["waited_for_same_candidate"] is True
    assert trial.user_attrs["reused_from"] == other.number
    assert trial.user_attrs["worker"] == "w1"


# --- make_objective: launched -------------------------------------------------------------------------------------

def test_an_oom_stopped_above_the_budget_keeps_what_it_measured(tiny):
    assert tiny.hardware.device_reserve_bytes == 0
    stopped = TrialResult(outcome=Outcome.OOM, ranks=(_rank(training=1_800_000, init=600_000, peak=2_000_000),),
                          message="stopped above the limit", wall_s=12.5, stopped_at="step 1")
    calls: list = []
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, tiny, baseline_candidate(tiny.training))
    with pytest.raises(TrialFailed):
        _objective(tiny, calls, stopped)(trial)
    attrs = trial.user_attrs
    assert calls == [BASE_LABEL]  # an OOM is the candidate's: not launched again
    assert (attrs["outcome"], attrs["wall_s"], attrs["stopped_at"]) == ("oom", 12.5, "step 1")
    assert attrs["peak_memory_bytes"] == 2_000_000
    # no offload: nothing of the ledger is on the host, so the device share is what was measured (+ reserve 0)
    assert attrs["predicted_host_bytes"] == 0 and attrs["predicted_init_host_bytes"] == 0
    assert attrs["device_share_bytes"] == 1_800_000 and attrs["init_device_share_bytes"] == 600_000
    assert attrs["message"] == "stopped above the limit"


def test_on_cpu_ranks_the_ledgers_host_items_are_taken_off_the_measured_memory(tiny):
    offload = replace(baseline_candidate(tiny.training), zero_stage=ZeroStage.OPTIMIZER,
                      offload_optimizer=OffloadDevice.CPU)
    calls: list = []
    study = optuna.create_study(directions=list(DIRECTIONS))
    trial = _asked(study, tiny, offload)
    values = _objective(tiny, calls, _ok(training=3_000_000, init=1_000_000))(trial)
    attrs = trial.user_attrs
    assert attrs["predicted_host_bytes"] == 1_271_296  # module docstring: the offloaded partitions + temp buffer
    assert attrs["predicted_init_host_bytes"] == 723_456  # 3 × 241,152
    assert values == (3_000_000 - 1_271_296, 1000.0) == (1_728_704, 1000.0)
    assert attrs["memory_objective_bytes"] == 1_728_704
    assert attrs["init_device_share_bytes"] == 1_000_000 - 723_456 == 276_544
    assert (attrs["outcome"], attrs["wall_s"], attrs["attempts"], attrs["launches"]) == ("ok", 7.25, 1, 1)
    assert attrs["peak_memory_bytes"] == 3_000_000 and "fidelity_unknown" not in attrs
