"""``dsopt ledger STUDY --calibrated``: predicted vs measured per trial, before and after calibration."""

from __future__ import annotations

from collections.abc import Sequence

import optuna

from optimizer.perf.rates import FEATURES
from optimizer.perf.throughput import StepTime, predict, profile_rates, work
from optimizer.search.ordering import (
    StudyModels,
    candidate_of,
    device_bytes_measured,
    device_bytes_predicted,
    measured_trials,
)
from optimizer.study.specs import TransformerModel, baseline_candidate
from optimizer.study.study_file import StudySpec


def _error(predicted: float | None, measured: float | None) -> str:
    if not predicted or not measured:
        return "-"
    return f"{(predicted - measured) / measured:+.1%}"


def _speed(step: StepTime | str) -> float | None:
    return step.tokens_per_s if isinstance(step, StepTime) else None


def calibration_table(*, spec: StudySpec, trials: Sequence[optuna.trial.FrozenTrial], models: StudyModels) -> str:
    """One row per measured trial: device memory (ledger, calibrated, measured) and tokens/s (profile model,
    calibrated model, measured), with the relative errors; then the fitted figures."""
    assert isinstance(spec.model, TransformerModel)
    base = baseline_candidate(spec.training)
    prior = profile_rates(hardware=spec.hardware)
    factors = ", ".join(f"{group} x{factor:.3f}" for group, factor in models.memory_factors) or "none"
    lines = [f"study {spec.name}: {len(measured_trials(trials))} measured trial(s); time model {models.rates.source}; "
             f"memory factors by group: {factors}; MB = 10^6 bytes", "",
             "| trial | candidate | measured MB | ledger MB | err | calibrated MB | err | measured tokens/s | "
             "model tokens/s | err | calibrated tokens/s | err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in measured_trials(trials):
        candidate = candidate_of(t.user_attrs["candidate"], base)
        job = work(candidate=candidate, model=spec.model, hardware=spec.hardware, training=spec.training)
        ranks = spec.hardware.world_size
        before = _speed(predict(job=job, rates=prior, ranks=ranks))
        after = _speed(predict(job=job, rates=models.rates, ranks=ranks))
        measured_speed = t.user_attrs.get("tokens_per_s")
        device = device_bytes_measured(t)
        ledger = device_bytes_predicted(t)
        calibrated = ledger * models.memory_factor(candidate)
        lines.append(
            f"| {t.number} | {candidate.label()} | {device / 1e6:.3f} | {ledger / 1e6:.3f} | {_error(ledger, device)} "
            f"| {calibrated / 1e6:.3f} | {_error(calibrated, device)} | {measured_speed or 0:,.0f} | "
            + (f"{before:,.0f}" if before else "unknown") + f" | {_error(before, measured_speed)} | "
            + (f"{after:,.0f}" if after else "unknown") + f" | {_error(after, measured_speed)} |")
    lines += ["", "fitted seconds per unit (profile → calibrated):"]
    for name, p, c in zip(FEATURES, prior.seconds_per, models.rates.seconds_per, strict=True):
        lines.append(f"  {name:<15} {'unknown' if p is None else f'{p:.3e}':>10} → "
                     f"{'unknown' if c is None else f'{c:.3e}'}")
    return "\n".join(lines)
