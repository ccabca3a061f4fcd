"""The launch policy in a running study (optimizer/search/launch_policy.py assesses, optimizer/search/next_launch.py
chooses, optimizer/search/objective.py holds or launches, launchers/study/study_run.py counts and stops): a risky best
candidate is held on a plain proposal and launched when the policy picks it; a trial without a loss fidelity is
never on the front nor picked; ``--n-trials`` and ``budget.max_launches`` count real launches only; a stop by a
limit lists what was left untried.

No DeepSpeed: ``run_study``'s runner returns stated measurements — every candidate's device memory is exactly the
ledger's training need (so the ledger is never wrong here and only the policy is under test), its tokens/s a
stated figure. The study uses cpu-tiny with formula activations (the trace takes tens of seconds and is not under
test) and a small search space: ZeRO 1 and 2, bf16 (fp32 where said), no checkpointing, micro-batch 1, 2 and 4.

The ledger's training needs per rank on that space (cpu-tiny, formula activations; optimizer/ledger):
z1 bf16 mbs=1/2/4: 1,623,552 / 2,033,152 / 2,852,352 B; z2 bf16 mbs=1/2/4: 1,704,960 / 2,114,560 / 2,792,960 B
(with accumulation the earlier micro-batches' partition beside the new one);
z1 fp32 mbs=4: 4,719,104 B, of which 3,014,656 B estimated.
"""

from __future__ import annotations

import io
import re
from dataclasses import replace

import optuna
import pytest

from launchers.study.progress import ProgressMode
from launchers.study.study_run import run_study
from optimizer.ledger.core import evaluate
from optimizer.results.pareto import pick_trial
from optimizer.results.trial_result import Outcome, RankMeasurement, TrialResult
from optimizer.search.coordination import WORKER_ATTR, budget_spent, launches_used, now_utc
from optimizer.search.launch_policy import SAFE_FIT_PROBABILITY, Standing, assess
from optimizer.search.objective import open_study
from optimizer.search.ordering import study_models
from optimizer.search.space import branches, distribution_params
from optimizer.search.study_loop import setup_study, worker_launches
from optimizer.study.cluster_settings import BudgetSettings
from optimizer.study.errors import UserError
from optimizer.study.knobs import Precision, ZeroStage, parse_checkpointing
from optimizer.study.search_space import SearchSpace
from optimizer.study.specs import ActivationSource, baseline_candidate

COMPLETE, PRUNED = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED
BUDGET = 2_910_000
"""A per-rank budget under which z1 bf16 mbs=4 (2,852,352 B: 98.0 %) and z2 bf16 mbs=4 (96.4 %) are risky before
any measurement. Once its group (z1 bf16, no checkpointing) is measured exact, z1 bf16 mbs=4's margin is the 3 %
floor, 85,571 B: z = 2 x 57,648 / 85,571 = 1.35, P = 0.91 — still risky, so only the launch policy launches it (at
95 % of the budget it would turn safe, P = 0.9997, after the first measurement of its group: no risk left to price)."""
PROPOSAL_CAP = 60
"""More proposals than any of these studies needs (a dozen at most): a study that never ends fails, not hangs."""
FASTEST = "z1 bf16 ckpt=none mbs=4"


class CappedTPE(optuna.samplers.TPESampler):
    """TPE with a fixed seed that refuses a proposal past :data:`PROPOSAL_CAP`."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.proposals = 0

    def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self.proposals += 1
        if self.proposals > PROPOSAL_CAP:
            raise RuntimeError(f"more than {PROPOSAL_CAP} proposals: the study does not stop")
        super().before_trial(study, trial)


def _spec(tiny, *, budget: int | None = None, fp32: bool = False, micro_batches=(1, 2, 4)):
    space = SearchSpace(values=(("zero_stage", (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS)),
                                ("precision", (Precision.BF16, Precision.FP32) if fp32 else (Precision.BF16,)),
                                ("checkpointing", (parse_checkpointing("none"),)),
                                ("micro_batch_size", micro_batches)), source="test")
    hardware = tiny.hardware if budget is None else replace(tiny.hardware, gpu_memory_bytes=budget)
    return replace(tiny, model=replace(tiny.model, activations=ActivationSource.FORMULA), search_space=space,
                   hardware=hardware)


def _speed(candidate) -> float:
    """Stated tokens/s: 1,000 per sample of the micro-batch, ZeRO-1 500 more (less communication), fp32 half."""
    tokens = 1000.0 * candidate.micro_batch_size + (500.0 if candidate.zero_stage is ZeroStage.OPTIMIZER else 0.0)
    return tokens / 2 if candidate.precision is Precision.FP32 else tokens


def _runner(spec, calls: list, *, fidelity=lambda candidate: 0.0, crash_first: bool = False, speed=_speed):
    """A stated runner: memory as the ledger predicts it, ``speed``'s tokens/s, ``fidelity``'s loss fidelity; with
    ``crash_first`` the very first launch crashes (a transient failure: the retry is ok)."""

    def runner(candidate, _reference_losses) -> TrialResult:
        calls.append(candidate.label())
        if crash_first and len(calls) == 1:
            return TrialResult(outcome=Outcome.CRASH, message="port already in use", wall_s=1.0)
        ledger = evaluate(candidate=candidate, model=spec.model, hardware=spec.hardware,
                          training=spec.training).ledger
        # The objective's device share is peak + device reserve − the ledger's host share: exactly the need.
        peak = ledger.training_needed_bytes + ledger.training_host_share_bytes - spec.hardware.device_reserve_bytes
        rank = RankMeasurement(rank=0, peak_allocated_bytes=peak, peak_reserved_bytes=None, peak_rss_bytes=0,
                               step_times_s=(0.1,), training_peak_allocated_bytes=peak)
        return TrialResult(outcome=Outcome.OK, ranks=(rank,), losses=(5.0,), step_time_s=0.1, wall_s=1.0,
                           tokens_per_s=speed(candidate), loss_fidelity=fidelity(candidate))

    return runner


def _run(spec, runner, *, n_trials: int | None, monkeypatch, before=None) -> tuple[optuna.Study, str]:
    """run_study on a fresh SQLite file with the capped sampler; returns the study and what went to stderr.
    ``before(study)`` may enqueue proposals first (they are run before the setup's seeds: oldest first)."""
    storage = f"sqlite:///{spec.path.parent}/study.db"
    if before is not None:
        before(open_study(spec=spec, storage=storage))
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    study = run_study(spec=spec, storage=storage, n_trials=n_trials, timeout_s=None, runner=runner,
                      reference=lambda: [5.0], sampler=CappedTPE(), progress=ProgressMode.QUIET)
    return study, err.getvalue()


def _candidate(spec, label: str):
    return next(c for c in spec.search_space.candidates(baseline_candidate(spec.training)) if c.label() == label)


def _assessed(spec, label: str):
    """The candidate's standing before any measurement (the study's uncalibrated models)."""
    candidate = _candidate(spec, label)
    verdict = evaluate(candidate=candidate, model=spec.model, hardware=spec.hardware, training=spec.training)
    return assess(verdict, models=study_models(spec=spec, trials=[], base=baseline_candidate(spec.training)))


def _enqueue(study: optuna.Study, spec, *labels: str) -> None:
    """Plain proposals (no ``enqueued_by``: as the sampler's own), in this order."""
    for label in labels:
        study.enqueue_trial(distribution_params(_candidate(spec, label), branches(spec)))


def _launched(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if "launches" in t.user_attrs]


def test_the_best_is_held_at_first_and_the_study_finds_it(tiny, monkeypatch):
    spec = _spec(tiny, budget=BUDGET)
    before = _assessed(spec, FASTEST)
    # need n = 2,852,352 B, 1,638,400 B of it estimated; CPU prior margin m = max(3 % n + 0.25 x 1,638,400 =
    # 495,171, 10 % n = 285,235) = 495,171 B = two standard deviations: z = 2 x (2,910,000 − 2,852,352) / 495,171
    # = 0.2328; the init phase (723,456 B) is far under the budget: P = Φ(0.2328) = 0.5921 < Φ(2) = 0.977: risky.
    assert (before.standing, before.need_bytes, before.margin_bytes) == (Standing.RISKY, 2_852_352, 495_171)
    assert before.fit_probability == pytest.approx(0.5921, abs=1e-4)
    calls: list[str] = []
    # A plain proposal of it comes first (enqueued before the study's seeds), as TPE's random start might propose
    # it: stated, because whether TPE (seed 0) proposes it on its own before the policy picks it depends on the
    # policy's order, which is not under test here.
    study, err = _run(spec, _runner(spec, calls), n_trials=None, monkeypatch=monkeypatch,
                      before=lambda s: _enqueue(s, spec, FASTEST))
    first = study.trials[0]
    assert first.user_attrs["label"] == FASTEST and first.state is PRUNED and first.user_attrs["held"] is True
    assert "launches" not in first.user_attrs and first.user_attrs["pruned_reason"].startswith("held: needs 98.0 %")
    ran = [t for t in _launched(study) if t.user_attrs["label"] == FASTEST]
    assert len(ran) == 1 and ran[0].state is COMPLETE and "reused_from" not in ran[0].user_attrs
    assert ran[0].values == [2_852_352.0, 4_500.0]  # the ledger's need, measured; 4 x 1,000 + 500 tok/s
    assert ran[0].number in {t.number for t in study.best_trials}
    assert max(t.values[1] for t in study.best_trials) == 4_500.0 and calls.count(FASTEST) == 1
    # Launched risky (its group measured: P = 0.91, see BUDGET), so on the launch policy's choice; any other risky
    # launch too — a plain proposal of a risky candidate is held, never launched.
    assert ran[0].user_attrs["fit_probability"] == pytest.approx(0.911, abs=1e-3)
    for trial in _launched(study):
        if trial.user_attrs["fit_probability"] < SAFE_FIT_PROBABILITY:
            assert str(trial.user_attrs.get("enqueued_by", "")).startswith("model"), trial.number
    assert "stopping: the search space is exhausted: every candidate that may fit has a result (6 candidate(s))" \
        in err
    assert sorted(calls) == sorted(c.label() for c in spec.search_space.candidates(baseline_candidate(spec.training)))


def test_a_trial_without_a_fidelity_is_neither_on_the_front_nor_picked(tiny, monkeypatch):
    spec = _spec(tiny)  # 2 GiB: every candidate safe
    lean = "z1 bf16 ckpt=none mbs=1"  # the leanest (1,623,552 B); stated the fastest too: it dominates them all

    def speed(candidate) -> float:
        return 9_000.0 if candidate.label() == lean else _speed(candidate)

    calls: list[str] = []
    runner = _runner(spec, calls, speed=speed, fidelity=lambda c: None if c.label() == lean else 0.0)
    study, _ = _run(spec, runner, n_trials=None, monkeypatch=monkeypatch)
    unknown = [t for t in study.trials if t.user_attrs.get("label") == lean and t.state is COMPLETE]
    assert calls.count(lean) == 1 and unknown
    for trial in unknown:  # the launched one and any reuse of it
        assert trial.user_attrs["loss_fidelity"] is None and trial.user_attrs["fidelity_unknown"] is True
        assert trial.constraints["loss_fidelity"] == 1.0  # UNKNOWN_FIDELITY: violated, never feasible
        assert trial.values == [1_623_552.0, 9_000.0]
    front = {t.number for t in study.best_trials}
    assert front and not front & {t.number for t in unknown}
    fastest = pick_trial(study, "fastest")
    assert (fastest.user_attrs["label"], fastest.values[1]) == (FASTEST, 4_500.0)  # the next fastest
    assert pick_trial(study, "smallest").user_attrs["label"] != lean
    with pytest.raises(UserError, match="violates the loss-fidelity constraint"):
        pick_trial(study, f"trial={unknown[0].number}")


def test_a_retry_is_a_launch_and_n_trials_counts_it(tiny, monkeypatch):
    spec = _spec(tiny)
    assert spec.trial.retries == 1  # cpu-tiny states none: the default, one retry of a crash or timeout
    calls: list[str] = []
    study, err = _run(spec, _runner(spec, calls, crash_first=True), n_trials=4, monkeypatch=monkeypatch)
    assert len(calls) == 4  # 1 crash + its retry + 2 more trials; the stated reference is no launch
    retried = _launched(study)[0]
    assert retried.state is COMPLETE and retried.user_attrs["failed_attempts"][0]["outcome"] == "crash"
    assert (retried.user_attrs["launches"], retried.user_attrs["attempts"]) == (2, 2)
    assert launches_used([retried]) == 2 and len(_launched(study)) == 3
    assert launches_used(study.trials) == 4
    assert study.user_attrs["dsopt_reference_launches"] == 0  # run_study given reference=: nothing launched
    assert "stopping: this worker made its 4 launch(es)" in err


def test_the_reference_launch_is_recorded_and_counted_by_the_budget(tiny):
    spec = _spec(tiny)
    study = open_study(spec=spec, storage=f"sqlite:///{spec.path.parent}/study.db")
    setup_study(study=study, spec=spec, space=branches(spec), worker="w", key="k", reference=lambda: [5.0],
                say=lambda _: None, reference_launches=lambda: 1)
    reference = study.user_attrs["dsopt_reference_launches"]
    assert reference == 1 and study.user_attrs["reference_losses"] == [5.0]
    trials = study.get_trials()  # the seeds, waiting: no launch yet
    assert trials and launches_used(trials) == 0
    assert launches_used(trials, reference_launches=reference) == 1

    def spent(cap: int) -> str | None:
        return budget_spent(trials=trials, budget=BudgetSettings(max_launches=cap), created_at=None, now=now_utc(),
                            reference_launches=reference)

    assert spent(1) == "1 of budget.max_launches=1 launches used (retries and the FP32 reference included)"
    assert spent(2) is None


def test_reused_pruned_and_held_proposals_spend_no_launch(tiny, monkeypatch):
    spec = _spec(tiny, budget=BUDGET, fp32=True, micro_batches=(1, 4))
    pruned, small = "z1 fp32 ckpt=none mbs=4", "z1 bf16 ckpt=none mbs=1"
    # z1 fp32 mbs=4 needs 4,719,104 B of 2,910,000: margin max(3 % n + 0.25 x 3,014,656, 10 % n) = 895,238 B,
    # z = 2 x (2,910,000 − 4,719,104) / 895,238 = −4.04, P = 3e-5 < 0.02: pruned, never launched.
    assert _assessed(spec, pruned).standing is Standing.PRUNED
    assert _assessed(spec, FASTEST).standing is Standing.RISKY  # first test: P = 0.59
    calls: list[str] = []
    study, _ = _run(spec, _runner(spec, calls), n_trials=3, monkeypatch=monkeypatch,
                    before=lambda s: _enqueue(s, spec, pruned, FASTEST, small, small))
    first = study.trials[:4]
    assert [t.user_attrs.get("label") for t in first] == [pruned, FASTEST, small, small]
    assert first[0].state is PRUNED and first[0].user_attrs["pruned_reason"].startswith("does not fit")
    assert first[1].state is PRUNED and first[1].user_attrs["held"] is True
    assert first[2].state is COMPLETE and first[2].user_attrs["launches"] == 1
    assert first[3].state is COMPLETE and first[3].user_attrs["reused_from"] == first[2].number
    for trial in (first[0], first[1], first[3]):
        assert "launches" not in trial.user_attrs and "launch_claim" not in trial.user_attrs
    worker = first[2].user_attrs[WORKER_ATTR]
    assert len(calls) == 3 and calls[0] == small  # n_trials=3: three real launches, none spent on the others
    assert worker_launches(study.trials, worker=worker) == len(calls) == launches_used(study.trials)


def test_a_stop_by_n_trials_lists_the_candidates_left_untried(tiny, monkeypatch):
    spec = _spec(tiny, budget=BUDGET)
    calls: list[str] = []
    _, err = _run(spec, _runner(spec, calls), n_trials=2, monkeypatch=monkeypatch)
    assert len(calls) == 2
    assert "stopping: this worker made its 2 launch(es) (retries and the FP32 reference included)" in err
    # Six candidates, none pruned at 2.91 MB (the two at mbs=4 risky), two launched: four left.
    assert "4 candidate(s) that may fit were never tried" in err
    listed = re.findall(r"^  (z\d bf16 ckpt=none mbs=\d) +(?:predicted [\d,]+ tok/s|speed unknown), needs [\d.,]+ "
                        r"MB, probability to fit \d+%$", err, flags=re.MULTILINE)
    everything = {c.label() for c in spec.search_space.candidates(baseline_candidate(spec.training))}
    assert len(listed) == 4 and set(listed) == everything - set(calls)
