"""The throughput model's work terms against their published sources, and calibration on known data."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from optimizer.ledger.transformer import parameter_count
from optimizer.perf.calibration import MemorySample, TimeSample, fit_rates, memory_factor
from optimizer.perf.throughput import FEATURES, Rates, predict, predict_candidate, profile_rates, work
from optimizer.study.hardware_profiles import profile_named
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[1]
LLAMA_2_7B_PARAMETERS = 6_738_415_616  # published (Hugging Face model card); tests/test_transformer.py checks the count


@pytest.fixture(scope="module")
def llama():
    study = load_study(ROOT / "studies" / "llama-7b-8xh100.yaml")
    return replace(study, hardware=replace(study.hardware, profile=profile_named("h100-80gb")))


def _work(study, **knobs):
    candidate = with_knobs(baseline_candidate(study.training), knobs)
    return work(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)


def test_compute_is_about_six_flops_per_parameter_per_token(llama):
    # Kaplan et al. 2020: C ≈ 6·N per token for training; attention adds 6·L·s·h.
    job = _work(llama, zero_stage=0, checkpointing="none")
    per_token = job.flops / job.tokens
    assert per_token == pytest.approx(6 * parameter_count(llama.model), rel=0.15)


def test_full_recompute_adds_one_forward_of_the_blocks(llama):
    plain = _work(llama, checkpointing="none").flops
    full = _work(llama, checkpointing="full").flops
    selective = _work(llama, checkpointing="selective").flops
    assert 1.25 < full / plain < 4 / 3  # 4/3 without the LM head and embeddings
    assert plain < selective < full


def test_zero3_moves_one_and_a_half_times_data_parallel(llama):
    # ZeRO paper §7: DP and ZeRO-1/2 move 2Ψ per step, ZeRO-3 3Ψ (here without gradient accumulation).
    llama = replace(llama, training=replace(llama.training, global_batch_size=32))  # 4 x 8 ranks: 1 micro-step
    z0 = _work(llama, zero_stage=0, micro_batch_size=4)
    z1 = _work(llama, zero_stage=1, micro_batch_size=4)
    z3 = _work(llama, zero_stage=3, micro_batch_size=4)
    assert z0.micro_steps == 1
    assert z1.comm_bytes == z0.comm_bytes
    assert z3.comm_bytes_z3 == pytest.approx(1.5 * z0.comm_bytes)
    z2 = _work(llama, zero_stage=2, micro_batch_size=1)  # 4 micro-steps: gradients reduced each one
    assert z2.comm_bytes == pytest.approx(z0.comm_bytes * (z2.micro_steps + 1) / 2)


def test_offload_terms(llama):
    psi = LLAMA_2_7B_PARAMETERS
    job = _work(llama, zero_stage=3, offload_optimizer="cpu", precision="bf16")
    assert job.host_params == pytest.approx(psi / 8)
    assert job.pcie_bytes == pytest.approx(2 * psi / 8 * 2)


def test_h100_prediction_is_efficiency_times_peak(llama):
    candidate = with_knobs(baseline_candidate(llama.training), {"zero_stage": 1, "precision": "bf16",
                                                                 "micro_batch_size": 4})
    step = predict_candidate(candidate=candidate, model=llama.model, hardware=llama.hardware, training=llama.training)
    job = _work(llama, zero_stage=1, precision="bf16", micro_batch_size=4)
    compute_only = 989e12 * 0.4 * 8 / (job.flops / job.tokens)
    assert not isinstance(step, str)
    assert compute_only * 0.9 < step.tokens_per_s <= compute_only
    # ZeRO-1 all-reduces the bf16 gradients once per step: 2 ring passes of 7/8 · Ψ · 2 bytes (ZeRO paper §7),
    # at 450 GB/s per direction (half of NVLink 4's 900 GB/s bidirectional, docs/sources.md): 0.0524 s.
    ring_pass_bytes = 7 / 8 * LLAMA_2_7B_PARAMETERS * 2
    assert dict(step.terms_s)["communication"] == pytest.approx(2 * ring_pass_bytes / 450e9)


def test_unknown_hardware_says_unknown(llama):
    bare = replace(llama.hardware, profile=None)
    candidate = baseline_candidate(llama.training)
    assert predict_candidate(candidate=candidate, model=llama.model, hardware=bare,
                             training=llama.training).startswith("unknown")
    nvme = with_knobs(candidate, {"zero_stage": 3, "offload_optimizer": "nvme"})
    no_nvme_figure = replace(llama.hardware, nvme_bytes_per_s=None)
    reason = predict_candidate(candidate=nvme, model=llama.model, hardware=no_nvme_figure, training=llama.training)
    assert isinstance(reason, str) and "nvme" in reason
    assert not isinstance(predict_candidate(candidate=nvme, model=llama.model, hardware=llama.hardware,
                                            training=llama.training), str)  # the study gives 6 GB/s


def _cpu_jobs():
    study = load_study(ROOT / "studies" / "cpu-tiny.yaml")
    base = baseline_candidate(study.training)
    jobs = [work(candidate=c, model=study.model, hardware=study.hardware, training=study.training)
            for c in study.search_space.candidates(base)
            if not (c.zero_stage == 0 and c.offload_optimizer.value != "none")]
    return study, jobs


def test_calibration_recovers_known_rates_from_measurements():
    study, jobs = _cpu_jobs()
    truth = Rates(seconds_per=(2e-9, 1e-9, 3e-9, 4e-9, 1e-8, 5e-8, 0.0, 0.004, 0.01, 0.02, 0.05), source="truth",
                  overlap_z3=False)
    measured = [TimeSample(work=j, step_time_s=predict(job=j, rates=truth, ranks=2).total_s) for j in jobs[::5]]
    fitted = fit_rates(measured, prior=profile_rates(hardware=study.hardware))
    assert fitted.source == f"calibrated on {len(measured)} trial(s)"
    errors = [abs(predict(job=j, rates=fitted, ranks=2).total_s / predict(job=j, rates=truth, ranks=2).total_s - 1)
              for j in jobs]
    assert max(errors) < 0.05
    assert all(v is None or v >= 0 for v in fitted.seconds_per)


def test_calibration_without_samples_is_the_prior_and_unknown_stays_unknown():
    study, _ = _cpu_jobs()
    prior = profile_rates(hardware=study.hardware)
    assert fit_rates([], prior=prior) is prior
    assert prior.seconds_per == (None,) * len(FEATURES)


def test_memory_factor_is_the_median_ratio_but_never_prunes_a_measured_fit():
    samples = [MemorySample(predicted_bytes=100, measured_bytes=120, fits_budget_bytes=200),
               MemorySample(predicted_bytes=100, measured_bytes=130, fits_budget_bytes=200),
               MemorySample(predicted_bytes=180, measured_bytes=190, fits_budget_bytes=200)]
    k = memory_factor(samples)
    assert k == pytest.approx(200 / 180)  # the median ratio 1.2 would predict 216 > 200 for the third
