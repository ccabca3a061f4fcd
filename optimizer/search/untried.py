"""What a study left untried: the candidates that may fit and were never launched, in launch order, with their
predicted speed and probability to fit — said when a limit stops the study, listed by ``dsopt pareto`` and
drawn on its plot (pure)."""

from __future__ import annotations

from collections.abc import Sequence

import optuna

from optimizer.ledger.core import evaluate
from optimizer.search.next_launch import Option, options
from optimizer.search.ordering import study_models
from optimizer.search.space import branches, in_space
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import StudySpec

SHOWN = 10
"""How many untried candidates a message lists by name (the rest are counted)."""


def untried_options(spec: StudySpec, trials: Sequence[optuna.trial.FrozenTrial]) -> list[Option]:
    """The study's untried candidates, as its launch policy would order them now (the study's own models
    refitted from ``trials``)."""
    space = branches(spec)
    base = baseline_candidate(spec.training)
    verdicts = [v for v in (evaluate(candidate=c, model=spec.model, hardware=spec.hardware, training=spec.training)
                            for c in spec.search_space.candidates(base))
                if v.ledger is not None and in_space(v.candidate, space)]
    models = study_models(spec=spec, trials=list(trials), base=base)
    return options(spec=spec, space=space, trials=list(trials), models=models, verdicts=verdicts,
                   include_queued=True)


def untried_text(untried: Sequence[Option], *, shown: int = SHOWN) -> str:
    """A few lines: how many candidates that may fit were never tried, the first ``shown`` in launch order."""
    if not untried:
        return "no candidate that may fit is left untried"
    lines = [f"{len(untried)} candidate(s) that may fit were never tried (in the order the study would launch "
             "them; MB = 10^6 bytes):"]
    for option in untried[:shown]:
        speed = "speed unknown" if option.tokens_per_s is None else f"predicted {option.tokens_per_s:,.0f} tok/s"
        lines.append(f"  {option.candidate.label():<34} {speed}, needs {option.assessment.need_bytes / 1e6:,.3f} "
                     f"MB, probability to fit {option.assessment.fit_probability:.0%}")
    if len(untried) > shown:
        lines.append(f"  … and {len(untried) - shown} more")
    return "\n".join(lines)
