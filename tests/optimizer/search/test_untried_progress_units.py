"""Unit tests of two pure formatters: ``untried_text`` (optimizer/search/untried.py: the lines naming the candidates
that may fit and were never tried) and ``trial_summary``/``trial_line`` (optimizer/search/progress.py) at the edges
the other progress tests leave open: a reason of exactly ``REASON_CHARS`` characters, a pruned trial that carries
values.

Where the expected values come from:
- ``untried_text``'s line format is the one its source writes out: a header counting the candidates ("MB = 10^6
  bytes"), then per candidate two spaces, the label left-aligned in 34 characters, the predicted speed (``,.0f``
  tok/s, or "speed unknown"), the need in MB (``,.3f``) and the probability to fit (``.0%``), at most ``shown``
  of them and "… and N more"; the numbers below are worked by hand from Python's format-spec rules;
- labels are ``Candidate.label()``'s documented spelling (``z2 bf16 ckpt=full mbs=4 opt->cpu``);
- ``REASON_CHARS = 80`` (progress.py: a reason is cut *to* this many characters, so one of exactly 80 is kept);
- a pruned Optuna trial may carry values (Optuna stores the last reported ones); progress.py's docstring says only
  a measured (complete) trial has objectives on its line and in its JSON record.
"""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from optimizer.search.launch_policy import Assessment, Standing
from optimizer.search.next_launch import Option
from optimizer.search.progress import trial_line, trial_summary
from optimizer.search.untried import untried_text
from optimizer.study.knobs import Candidate, OffloadDevice, Precision, ZeroStage, parse_checkpointing
from optimizer.study.specs import baseline_candidate

# --- untried_text -----------------------------------------------------------------------------------------------


def _option(stage: int, precision: str, *, ckpt: str = "none", mbs: int = 1, offload: str = "none",
            tokens_per_s: float | None, need_bytes: int, fit: float) -> Option:
    candidate = Candidate(zero_stage=ZeroStage(stage), precision=Precision(precision), micro_batch_size=mbs,
                          checkpointing=parse_checkpointing(ckpt), offload_optimizer=OffloadDevice(offload),
                          offload_param=OffloadDevice.NONE)
    assessment = Assessment(standing=Standing.SAFE if fit == 1.0 else Standing.RISKY, fit_probability=fit,
                            need_bytes=need_bytes, margin_bytes=1_000_000, reason="")
    return Option(candidate=candidate, assessment=assessment, tokens_per_s=tokens_per_s, value=0.0, order=())


HEADER = "candidate(s) that may fit were never tried (in the order the study would launch them; MB = 10^6 bytes):"


def _row(label: str, rest: str) -> str:
    """Two spaces, the label padded to 34 characters, a space, then the rest."""
    return "  " + label + " " * (34 - len(label)) + " " + rest


def test_nothing_untried_is_one_sentence():
    assert untried_text([]) == "no candidate that may fit is left untried"
    assert untried_text((), shown=0) == "no candidate that may fit is left untried"


def test_each_untried_candidate_names_speed_need_and_probability():
    first = _option(2, "bf16", ckpt="full", mbs=4, offload="cpu", tokens_per_s=12_345.6, need_bytes=2_440_123_456,
                    fit=0.9)
    second = _option(0, "fp32", tokens_per_s=987.4, need_bytes=999_999, fit=1.0)
    # 12_345.6 -> ",.0f" "12,346"; 2_440_123_456 / 10^6 = 2440.123456 -> ",.3f" "2,440.123"; 0.9 -> ".0%" "90%"
    # 987.4 -> "987"; 999_999 / 10^6 = 0.999999 -> "1.000"; 1.0 -> "100%"
    assert untried_text([first, second]).split("\n") == [
        "2 " + HEADER,
        _row("z2 bf16 ckpt=full mbs=4 opt->cpu", "predicted 12,346 tok/s, needs 2,440.123 MB, probability to fit 90%"),
        _row("z0 fp32 ckpt=none mbs=1", "predicted 987 tok/s, needs 1.000 MB, probability to fit 100%"),
    ]


def test_a_candidate_without_a_predicted_speed_says_speed_unknown():
    option = _option(3, "bf16", mbs=2, tokens_per_s=None, need_bytes=1_500_000, fit=0.25)
    # 1_500_000 / 10^6 = 1.5 -> "1.500"; 0.25 -> "25%"
    assert untried_text([option]) == "1 " + HEADER + "\n" + _row(
        "z3 bf16 ckpt=none mbs=2", "speed unknown, needs 1.500 MB, probability to fit 25%")


def test_the_need_is_in_units_of_exactly_one_million_bytes():
    # 7_000_007_000 / 10^6 = 7000.007 -> "7,000.007" (a divisor of 1_000_001 would give 7000.000000 -> "7,000.000")
    option = _option(1, "fp16", tokens_per_s=1.0, need_bytes=7_000_007_000, fit=0.5)
    assert untried_text([option]).endswith("predicted 1 tok/s, needs 7,000.007 MB, probability to fit 50%")


def test_only_the_first_shown_are_named_and_the_rest_counted():
    options = [_option(0, "fp32", mbs=m, tokens_per_s=float(m), need_bytes=m * 1_000_000, fit=1.0)
               for m in (1, 2, 3, 4, 5)]
    lines = untried_text(options, shown=2).split("\n")
    assert lines == ["5 " + HEADER,
                     _row("z0 fp32 ckpt=none mbs=1", "predicted 1 tok/s, needs 1.000 MB, probability to fit 100%"),
                     _row("z0 fp32 ckpt=none mbs=2", "predicted 2 tok/s, needs 2.000 MB, probability to fit 100%"),
                     "  … and 3 more"]  # 5 - 2 = 3
    # shown equal to the count: every one named, no "more" line
    assert untried_text(options[:2], shown=2).split("\n") == ["2 " + HEADER, *lines[1:3]]


def test_ten_are_named_by_default():
    options = [_option(0, "fp32", mbs=m, tokens_per_s=None, need_bytes=0, fit=1.0) for m in range(1, 13)]
    lines = untried_text(options).split("\n")
    # SHOWN = 10: the header, ten rows, "… and 2 more" (12 - 10)
    assert len(lines) == 12
    assert lines[0] == "12 " + HEADER
    assert lines[10] == _row("z0 fp32 ckpt=none mbs=10", "speed unknown, needs 0.000 MB, probability to fit 100%")
    assert lines[11] == "  … and 2 more"


# --- progress: trial_line at the cut, trial_summary of a pruned trial with values ---------------------------------

# head: f"#{7:<3}" = "#7  ", a space, the label left-aligned in 34 characters
LABEL = "z2 bf16 ckpt=full mbs=4"
HEAD_7 = "#7   " + LABEL + " " * (34 - len(LABEL))


def _failed_summary(reason: str, *, status: str = "error", wall_s: float | None = None) -> dict:
    return {"trial": 7, "status": status, "label": LABEL, "memory_bytes": None, "tokens_per_s": None,
            "on_front": False, "reason": reason, "wall_s": wall_s}


def test_a_reason_of_exactly_80_characters_is_kept_whole():
    assert trial_line(_failed_summary("r" * 80)) == HEAD_7 + " error: " + "r" * 80


def test_a_reason_of_81_characters_is_cut_to_79_and_an_ellipsis():
    assert trial_line(_failed_summary("a" * 80 + "b")) == HEAD_7 + " error: " + "a" * 79 + "…"


def test_the_cut_counts_the_reason_after_its_status_prefix_and_collapsed_spaces():
    # "oom: " is dropped and the run of spaces and the newline collapse: 40 + 1 + 39 = 80 characters, kept whole
    summary = _failed_summary("oom: " + "x" * 40 + "  \n " + "y" * 39, status="oom", wall_s=2.4)
    assert trial_line(summary) == HEAD_7 + " oom: " + "x" * 40 + " " + "y" * 39 + " (cost 2 s)"  # 2.4 -> "2"


def _frozen(state: TrialState, *, values: list[float] | None, **attrs: object) -> optuna.trial.FrozenTrial:
    study = optuna.create_study(directions=["minimize", "maximize"])
    study.add_trial(optuna.trial.create_trial(state=state, values=values, user_attrs=attrs))
    return study.trials[0]


def test_a_pruned_trial_that_carries_values_has_no_objectives(tiny):
    base = baseline_candidate(tiny.training)
    knobs = {**base.knobs(), "zero_stage": 2, "precision": "bf16", "checkpointing": "full", "micro_batch_size": 4}
    frozen = _frozen(TrialState.PRUNED, values=[3_000_000.0, 42.0], candidate=knobs,
                     pruned_reason="does not fit: 3.43 MB of 3.00 MB", launches=0)
    summary = trial_summary(frozen, base=base, on_front=False)
    assert summary == {"trial": 0, "status": "pruned", "label": LABEL, "knobs": knobs, "memory_bytes": None,
                       "tokens_per_s": None, "loss_fidelity": None, "on_front": False,
                       "reason": "does not fit: 3.43 MB of 3.00 MB", "worker": None, "launches": 0, "wall_s": None}
    assert trial_line(summary) == "#0   " + LABEL + " " * 11 + " pruned: does not fit: 3.43 MB of 3.00 MB"


def test_a_complete_trial_keeps_its_values(tiny):
    base = baseline_candidate(tiny.training)
    frozen = _frozen(TrialState.COMPLETE, values=[1_234_567.8, 99.5], candidate=base.knobs(), launches=2,
                     wall_s=3.0)
    summary = trial_summary(frozen, base=base, on_front=True)
    # int(1_234_567.8) = 1_234_567 (truncated); tiny's baseline: z0 fp32 ckpt=none mbs=2 (studies/cpu-tiny.yaml)
    assert (summary["memory_bytes"], summary["tokens_per_s"], summary["status"]) == (1_234_567, 99.5, "measured")
    assert (summary["label"], summary["launches"], summary["wall_s"]) == ("z0 fp32 ckpt=none mbs=2", 2, 3.0)
