"""fp16 loss scaling in a trial: overflowed steps are skipped and replayed, a collapsed scale is a NaN (pure)."""

from __future__ import annotations

import math

import pytest

from optimizer.results.loss_scaling import StepKind, reference_indices, skip_allowance, step_kind
from optimizer.results.trial_result import Outcome, loss_fidelity, summarize

FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1}


@pytest.mark.parametrize(("loss", "norm", "applied", "scale", "kind"), [
    (2.0, 1.3, True, 65536.0, StepKind.APPLIED),
    (2.0, math.inf, False, 32768.0, StepKind.SKIPPED),      # an overflow the scaler absorbed
    (2.0, math.inf, False, 1.0, StepKind.NONFINITE),        # skipped at the minimum scale: collapsed
    (math.nan, 1.0, True, 65536.0, StepKind.NONFINITE),     # a NaN loss is a NaN whatever the scaler did
    (2.0, math.inf, True, None, StepKind.NONFINITE),        # bf16/fp32: no scaler, an inf norm is a failure
    (2.0, math.nan, False, None, StepKind.NONFINITE),       # not applied without a scaler: nothing absorbed it
    (2.0, None, True, None, StepKind.APPLIED),
])
def test_each_step_is_classified(loss, norm, applied, scale, kind):
    assert step_kind(loss=loss, grad_norm=norm, applied=applied, loss_scale=scale, min_loss_scale=1.0) is kind


def test_the_skip_allowance_covers_the_scaler_from_its_start_to_its_minimum():
    assert skip_allowance(FP16) == 2 * 17  # hysteresis × (16 halvings from 2^16 to 1, + the last)
    assert skip_allowance({**FP16, "initial_scale_power": 8, "min_loss_scale": 4}) == 2 * 7
    assert skip_allowance({**FP16, "loss_scale": 128}) == 0  # a static scale skips nothing
    assert skip_allowance(None) == skip_allowance({"enabled": False}) == 0


def test_after_a_skip_the_losses_compare_with_the_reference_at_the_updates_applied():
    assert reference_indices([False, False, True, True, False, True]) == [0, 0, 0, 1, 2, 2]
    reference = [5.0, 4.0, 3.0, 2.0]
    # the replayed batch after 0 updates gives the reference's first loss again, and so on
    losses = [5.0, 5.0, 5.0, 4.0, 3.3, 3.0]
    assert loss_fidelity(losses, reference, [False, False, True, True, False, True]) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        loss_fidelity(losses, reference, [True] * 6)  # more applied steps than the reference ran


def _fp16_report(rank):
    return {"rank": rank, "status": "ok", "losses": [2.0, 2.0, 2.0, 1.5, 1.0], "grad_norms": [None, None, 1, 1, 1],
            "applied": [False, False, True, True, True], "loss_scales": [65536.0, 32768.0, 32768.0, 32768.0, 32768.0],
            "step_times_s": [0.2, 0.4], "peak_allocated_bytes": 100, "peak_reserved_bytes": 120,
            "training_peak_allocated_bytes": 90, "training_peak_reserved_bytes": 110,
            "init_peak_allocated_bytes": 100, "init_peak_reserved_bytes": 105, "peak_rss_bytes": 1000}


def test_an_fp16_trial_with_overflows_is_ok_and_counts_them():
    result = summarize(rank_reports={0: _fp16_report(0), 1: _fp16_report(1)}, world_size=2, returncode=0,
                       timed_out=False, tokens_per_step=1000, reference_losses=[2.0, 1.5, 1.0], log_tail="",
                       wall_s=3.0)
    assert result.outcome is Outcome.OK
    assert result.skipped_steps == 2 and result.loss_scales[0] == 65536.0
    assert result.loss_fidelity == 0.0  # every attempt matches the reference at the updates applied before it
    assert result.tokens_per_s == pytest.approx(1000 / 0.3)  # only the applied, measured steps were timed
    assert result.training_device_bytes(device_reserve_bytes=7) == 117  # reserved + the reserve
    assert result.init_device_bytes(device_reserve_bytes=7) == 112
    assert result.peak_memory_bytes == 100 and result.training_peak_memory_bytes == 90
