"""Unit tests of optimizer/search/progress.py's pure formatters: ``trial_summary`` (the JSON record of a finished
trial), ``trial_line`` (the human line), ``duration_text``, ``status_text``, ``eta_s`` and ``counts``.

Every expected value is a literal worked by hand from the module's docstrings (the line format
``#7  z2 bf16 ckpt=full mbs=4  2.44 MB  10,099 tok/s  ✓ front``, MB = 10^6 bytes, ``1h02m``/``4m05s``/``37s``)
and Python's format-spec rules (``:<3`` left-pads to 3, ``:6.2f``, ``:>10,.0f``); the arithmetic is in comments.
"""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from optimizer.search.progress import counts, duration_text, eta_s, status_text, trial_line, trial_summary
from optimizer.study.specs import baseline_candidate

# tiny's baseline is z0 fp32 ckpt=none mbs=2 (studies/cpu-tiny.yaml: micro_batch_size 2, no other knob set)
Z2_KNOBS = {"zero_stage": 2, "offload_optimizer": "none", "offload_param": "none", "precision": "bf16",
            "checkpointing": "full", "micro_batch_size": 4}
Z2_LABEL = "z2 bf16 ckpt=full mbs=4"  # Candidate.label(): stage, precision, ckpt=, mbs= (module doc example)


def _study_with(*trials: optuna.trial.FrozenTrial) -> optuna.Study:
    study = optuna.create_study(directions=["minimize", "maximize"])
    for t in trials:
        study.add_trial(t)
    return study


def _frozen(state: TrialState, *, values: list[float] | None = None, params: dict | None = None,
            **attrs: object) -> optuna.trial.FrozenTrial:
    """One finished trial, numbered 0 by the study it is added to."""
    dist = {name: optuna.distributions.CategoricalDistribution([v]) for name, v in (params or {}).items()}
    trial = optuna.trial.create_trial(state=state, values=values, user_attrs=attrs, params=params or {},
                                      distributions=dist)
    return _study_with(trial).trials[0]


# --- trial_summary --------------------------------------------------------------------------------------------


def test_a_measured_trial_summary_holds_every_fact(tiny):
    base = baseline_candidate(tiny.training)
    frozen = _frozen(TrialState.COMPLETE, values=[2_440_000.0, 10_099.4], candidate=Z2_KNOBS,
                     loss_fidelity=0.012, worker="host:42", launches=1, wall_s=14.0)
    assert trial_summary(frozen, base=base, on_front=True) == {
        "trial": 0, "status": "measured", "label": Z2_LABEL, "knobs": Z2_KNOBS,
        "memory_bytes": 2_440_000, "tokens_per_s": 10_099.4, "loss_fidelity": 0.012, "on_front": True,
        "reason": "", "worker": "host:42", "launches": 1, "wall_s": 14.0}


def test_a_reused_trial_says_whose_result_and_has_no_wall_time(tiny):
    base = baseline_candidate(tiny.training)
    frozen = _frozen(TrialState.COMPLETE, values=[1_000_000.0, 5.0], candidate=Z2_KNOBS, reused_from=3,
                     wall_s=9.0)
    summary = trial_summary(frozen, base=base, on_front=False)
    assert (summary["status"], summary["reason"], summary["wall_s"]) == ("reused", "result of trial #3", None)
    assert (summary["memory_bytes"], summary["tokens_per_s"], summary["launches"]) == (1_000_000, 5.0, 0)


def test_a_trial_the_reference_run_measured_says_so_and_counts_no_launch(tiny):
    base = baseline_candidate(tiny.training)
    frozen = _frozen(TrialState.COMPLETE, values=[3_714_000.0, 28_258.0], candidate=Z2_KNOBS, launches=0,
                     measured_by="the FP32 reference run", wall_s=11.0)
    summary = trial_summary(frozen, base=base, on_front=True)
    assert (summary["status"], summary["reason"], summary["launches"]) == ("measured", "the FP32 reference run", 0)
    assert trial_line(summary).endswith("3.71 MB      28,258 tok/s  ✓ front  (the FP32 reference run)")


def test_pruned_and_held_trials_keep_their_reason_and_no_objectives(tiny):
    base = baseline_candidate(tiny.training)
    pruned = _frozen(TrialState.PRUNED, candidate=Z2_KNOBS, pruned_reason="does not fit: 3.43 MB of 3.00 MB")
    held = _frozen(TrialState.PRUNED, candidate=Z2_KNOBS, held=True, pruned_reason="held: margin 0.40 MB")
    bare = _frozen(TrialState.PRUNED, candidate=Z2_KNOBS)
    s_pruned, s_held, s_bare = (trial_summary(t, base=base, on_front=False) for t in (pruned, held, bare))
    assert (s_pruned["status"], s_pruned["reason"]) == ("pruned", "does not fit: 3.43 MB of 3.00 MB")
    assert (s_held["status"], s_held["reason"]) == ("held", "held: margin 0.40 MB")
    assert (s_bare["status"], s_bare["reason"]) == ("pruned", "")  # no pruned_reason: the empty default
    assert (s_pruned["memory_bytes"], s_pruned["tokens_per_s"], s_pruned["label"]) == (None, None, Z2_LABEL)


def test_a_failed_trial_takes_outcome_and_message_with_defaults(tiny):
    base = baseline_candidate(tiny.training)
    oom = _frozen(TrialState.FAIL, candidate=Z2_KNOBS, outcome="oom", message="stopped at step 1", wall_s=14.0)
    plain = _frozen(TrialState.FAIL, candidate=Z2_KNOBS)
    s_oom, s_plain = trial_summary(oom, base=base, on_front=False), trial_summary(plain, base=base, on_front=False)
    assert (s_oom["status"], s_oom["reason"], s_oom["wall_s"]) == ("oom", "stopped at step 1", 14.0)
    assert (s_plain["status"], s_plain["reason"], s_plain["wall_s"]) == ("error", "", None)


def test_without_a_candidate_attribute_the_label_is_the_params(tiny):
    base = baseline_candidate(tiny.training)
    frozen = _frozen(TrialState.COMPLETE, values=[1.0, 2.0], params={"zero_stage": 3})
    summary = trial_summary(frozen, base=base, on_front=False)
    assert (summary["label"], summary["knobs"]) == ("{'zero_stage': 3}", None)  # str() of the params dict


# --- trial_line -----------------------------------------------------------------------------------------------

# head: f"#{7:<3}" = "#7  ", a space, then the label left-aligned in 34 chars (23 chars + 11 spaces)
HEAD_7 = "#7   " + Z2_LABEL + " " * 11


def _summary(**over: object) -> dict:
    base = {"trial": 7, "status": "measured", "label": Z2_LABEL, "memory_bytes": 2_440_000, "tokens_per_s": 10_099.4,
            "on_front": True, "reason": "", "wall_s": 14.0}
    return {**base, **over}


def test_a_measured_line_on_the_front():
    # 2_440_000 / 1e6 = 2.44 -> f"{2.44:6.2f}" = "  2.44"; f"{10_099.4:>10,.0f}" = "10,099" right-aligned in 10
    assert trial_line(_summary()) == HEAD_7 + "   2.44 MB      10,099 tok/s  ✓ front"


def test_a_measured_line_behind_the_front_ends_at_the_speed():
    assert trial_line(_summary(on_front=False)) == HEAD_7 + "   2.44 MB      10,099 tok/s"


def test_a_reused_line_says_so_and_shows_no_cost():
    # 123_456_789 / 1e6 = 123.456789 -> "123.46"; 987_654.5 -> "987,654" (.5 rounds half to even: 987,654)
    line = trial_line(_summary(status="reused", memory_bytes=123_456_789, tokens_per_s=987_654.5, on_front=False))
    assert line == HEAD_7 + " 123.46 MB     987,654 tok/s  (reused)"


def test_a_failed_line_gives_reason_without_its_status_prefix_and_its_cost():
    summary = _summary(status="oom", memory_bytes=None, tokens_per_s=None, reason="oom:  stopped\nat step 1",
                       wall_s=13.6)
    # whitespace runs collapse to one space, "oom: " is removed, 13.6 s -> f"{13.6:.0f}" = "14"
    assert trial_line(summary) == HEAD_7 + " oom: stopped at step 1 (cost 14 s)"


def test_a_pruned_line_without_reason_or_wall_time_is_just_the_status():
    assert trial_line(_summary(status="pruned", memory_bytes=None, tokens_per_s=None, wall_s=None)) == \
        HEAD_7 + " pruned"


def test_a_long_reason_is_cut_to_80_characters_with_an_ellipsis():
    summary = _summary(status="held", memory_bytes=None, tokens_per_s=None, reason="y" * 100, wall_s=None)
    # REASON_CHARS = 80: 79 characters + "…"
    assert trial_line(summary) == HEAD_7 + " held: " + "y" * 79 + "…"


# --- duration_text, eta_s, status_text ------------------------------------------------------------------------


def test_duration_text_examples_from_its_docstring():
    assert duration_text(37) == "37s"
    assert duration_text(59.4) == "59s"  # rounds to 59, still under a minute
    assert duration_text(245) == "4m05s"  # 245 = 4·60 + 5
    assert duration_text(3725) == "1h02m"  # 3725 = 3600 + 2·60 + 5
    assert duration_text(0) == "0s"
    assert [duration_text(v) for v in (None, -1.0, float("inf"), float("nan"))] == ["?"] * 4


def test_eta_is_the_mean_wall_time_times_the_launches_left():
    assert eta_s(wall_s=[10.0, 20.0], left=3) == 45.0  # mean 15 s · 3
    assert eta_s(wall_s=[12.0], left=-2) == 0.0  # negative left counts as none
    assert eta_s(wall_s=[], left=3) is None


def test_status_line_with_target_best_and_eta():
    text = status_text(counts={"measured": 2, "reused": 0, "pruned": 1, "held": 3, "failed": 0, "running": 1},
                       ran=6, launches=3, target=10, now=None, best=(4, 1_234.6), eta_s=245.0)
    # kinds with a zero count are left out, "running" is never listed; 1_234.6 -> "1,235"; 245 s -> "4m05s"
    assert text == ("launches 3/10 (retries, reference incl.) · trials 6 · measured 2 pruned 1 held 3 · "
                    "best #4 1,235 tok/s · ETA 4m05s")


def test_status_line_without_target_or_best():
    text = status_text(counts={}, ran=0, launches=0, target=None, now="z1 fp32 ckpt=none mbs=1", best=None,
                       eta_s=None)
    assert text == "launches 0 · trials 0 · now z1 fp32 ckpt=none mbs=1 · best none yet"


# --- counts ---------------------------------------------------------------------------------------------------


def _counting_study() -> optuna.Study:
    """2 measured, 1 reused, 1 pruned, 1 held, 1 failed, 1 running."""
    made = [optuna.trial.create_trial(state=TrialState.COMPLETE, values=[1.0, 1.0]),
            optuna.trial.create_trial(state=TrialState.COMPLETE, values=[2.0, 2.0]),
            optuna.trial.create_trial(state=TrialState.COMPLETE, values=[3.0, 3.0], user_attrs={"reused_from": 0}),
            optuna.trial.create_trial(state=TrialState.PRUNED, user_attrs={"pruned_reason": "does not fit"}),
            optuna.trial.create_trial(state=TrialState.PRUNED, user_attrs={"held": True}),
            optuna.trial.create_trial(state=TrialState.FAIL),
            optuna.trial.create_trial(state=TrialState.RUNNING)]
    return _study_with(*made)


def test_counts_by_kind_from_the_study():
    assert counts(_counting_study()) == {"measured": 2, "reused": 1, "pruned": 1, "held": 1, "failed": 1,
                                         "running": 1}


def test_counts_of_given_trials_ignore_the_study():
    study = _counting_study()
    reused_and_held = [study.trials[2], study.trials[4]]
    assert counts(study, trials=reused_and_held) == {"measured": 0, "reused": 1, "pruned": 0, "held": 1,
                                                     "failed": 0, "running": 0}
