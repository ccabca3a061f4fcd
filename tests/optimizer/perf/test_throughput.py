"""The throughput model's work terms against their published sources, and calibration on known data."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from optimizer.ledger.transformer import parameter_count
from optimizer.perf.calibration import MemorySample, TimeSample, fit_rates, memory_factor
from optimizer.perf.throughput import FEATURES, Rates, Work, predict, predict_candidate, profile_rates, work
from optimizer.study.hardware_profiles import profile_named
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import HardwareSpec, TrainingSpec, TransformerModel, baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]
# published (Hugging Face model card); tests/optimizer/ledger/test_transformer.py checks the count
LLAMA_2_7B_PARAMETERS = 6_738_415_616
# Training FLOPs per token of studies/llama-7b-8xh100.yaml (L 32, h 4096, V 32000 untied, s 4096), by hand from
# Kaplan et al. 2020 Table 1 as optimizer/perf/throughput.py cites it: forward 2·N + 2·L·s·h + 2·V·h, training 3×.
# N (non-embedding) = 6,738,415,616 − 2 · 32000·4096 (embedding + LM head) = 6,476,271,616;
# forward = 12,952,543,232 + 2·32·4096·4096 (1,073,741,824) + 2·32000·4096 (262,144,000) = 14,288,429,056;
# training = 3 · 14,288,429,056 = 42,865,287,168.
LLAMA_2_7B_TRAINING_FLOPS_PER_TOKEN = 42_865_287_168

# A GPT-2-shaped model small enough to count by hand: L 2, h 64, a 4, f 256 (4h), V 256 tied, learned positions
# (32 rows), biases and LayerNorms; s 32, micro-batch 2, 2 ranks.
# Parameters (GPT-2 layout): per block LN 2·64 + q,k,v,o 4·(64·64 + 64) + LN 2·64 + fc 64·256 + 256 + proj 256·64 + 64
#   = 128 + 16,640 + 128 + 16,640 + 16,448 = 49,984; N = 2 blocks + final LN 128 = 100,096 (non-embedding);
#   Ψ = N + V·h 16,384 + positions 32·64 2,048 = 118,528.
TINY = TransformerModel(layers=2, hidden_size=64, heads=4, kv_heads=4, ffn_size=256, vocab_size=256, max_positions=32)
TINY_PSI = 118_528
TWO_RANKS = HardwareSpec(gpus_per_node=2, gpu_memory_bytes=80 * 10**9)


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
    assert per_token == pytest.approx(LLAMA_2_7B_TRAINING_FLOPS_PER_TOKEN)  # worked by hand above
    assert per_token == pytest.approx(6 * LLAMA_2_7B_PARAMETERS, rel=0.07)  # 42.87e9 / 40.43e9: 6 % over 6·N


def test_full_recompute_adds_one_forward_of_the_blocks(llama):
    plain = _work(llama, checkpointing="none").flops
    full = _work(llama, checkpointing="full").flops
    selective = _work(llama, checkpointing="selective").flops
    assert 1.25 < full / plain < 4 / 3  # 4/3 without the LM head and embeddings
    assert plain < selective < full


def _tiny(*, global_batch: int, **knobs: object) -> Work:
    training = TrainingSpec(global_batch_size=global_batch, micro_batch_size=2, sequence_length=32)
    candidate = with_knobs(baseline_candidate(training), knobs)
    return work(candidate=candidate, model=TINY, hardware=TWO_RANKS, training=training)


@pytest.mark.parametrize(("checkpointing", "per_token"), [
    # Kaplan et al. 2020 Table 1 (module doc): forward per token 2·N + 2·L·s·h + 2·V·h (LM head)
    #   = 2·100,096 + 2·2·32·64 + 2·256·64 = 200,192 + 8,192 + 32,768 = 241,152; training 3× = 723,456.
    ("none", 723_456),
    ("selective", 731_648),  # + the attention scores recomputed, 2·L·s·h = 8,192
    ("every_2", 827_648),  # + 1 block of 2 recomputed: (2·N + 2·L·s·h) / 2 = 208,384 / 2 = 104,192
    ("full", 931_840),  # + one forward of the blocks, 2·N + 2·L·s·h = 208,384
])
def test_flops_of_a_small_gpt_counted_by_hand(checkpointing, per_token):
    job = _tiny(global_batch=4, checkpointing=checkpointing)
    assert job.tokens == 64  # global batch 4 · s 32 / 2 ranks
    assert job.flops == per_token * 64
    # Narayanan et al. 2021 eq. 3 (Megatron-LM), biases and norms left out and both score matmuls counted:
    # 72·L·h²·(1 + s/6h + V/12Lh) = 589,824 · 1.25 = 737,280 per token without recompute, and with full recompute
    # 96·L·h²·(1 + s/6h + V/16Lh) = 786,432 · (1 + 1/12 + 1/8) = 950,272; the two counts agree within 2 %.
    if checkpointing in ("none", "full"):
        megatron = 737_280 if checkpointing == "none" else 950_272
        assert job.flops / job.tokens == pytest.approx(megatron, rel=0.02)


@pytest.mark.parametrize(("stage", "global_batch", "bytes_z02", "bytes_z3"), [
    # ZeRO paper §7 (Rajbhandari et al. 2020): data parallel and ZeRO-1/2 move 2Ψ per step (reduce-scatter +
    # all-gather), ZeRO-3 3Ψ; a ring collective moves (W − 1)/W = 1/2 of each per rank; fp32: 4 bytes.
    # One micro-step a step (global batch 4 = micro-batch 2 · 2 ranks): 2 · 1/2 · 118,528 · 4 = 474,112 bytes;
    # ZeRO-3 3 · 1/2 · 118,528 · 4 = 711,168 bytes (1.5×, the paper's 3Ψ / 2Ψ).
    (0, 4, 474_112, 0), (1, 4, 474_112, 0), (2, 4, 474_112, 0), (3, 4, 0, 711_168),
    # Two micro-steps (global batch 8): ZeRO-0/1 reduce once at the boundary (474,112); DeepSpeed's ZeRO-2
    # reduce-scatters every micro-step then all-gathers once: (2 + 1) · 1/2 · 118,528 · 4 = 711,168; ZeRO-3
    # gathers and reduces every micro-step: 2 · 711,168 = 1,422,336 (module doc).
    (0, 8, 474_112, 0), (1, 8, 474_112, 0), (2, 8, 711_168, 0), (3, 8, 0, 1_422_336),
])
def test_zero_communication_of_a_small_gpt_counted_by_hand(stage, global_batch, bytes_z02, bytes_z3):
    assert parameter_count(TINY) == TINY_PSI  # the Ψ counted by hand above
    job = _tiny(global_batch=global_batch, zero_stage=stage)
    assert job.micro_steps == global_batch // 4
    assert (job.comm_bytes, job.comm_bytes_z3) == (bytes_z02, bytes_z3)
    half = _tiny(global_batch=global_batch, zero_stage=stage, precision="bf16")  # 2-byte gradients: half as many
    assert (half.comm_bytes, half.comm_bytes_z3) == (bytes_z02 / 2, bytes_z3 / 2)


def test_offload_terms(llama):
    psi = LLAMA_2_7B_PARAMETERS
    job = _work(llama, zero_stage=3, offload_optimizer="cpu", precision="bf16")
    assert job.host_params == pytest.approx(psi / 8)
    assert job.pcie_bytes == pytest.approx(2 * psi / 8 * 2)


def test_h100_prediction_is_efficiency_times_peak(llama):
    candidate = with_knobs(baseline_candidate(llama.training), {"zero_stage": 1, "precision": "bf16",
                                                                 "micro_batch_size": 4})
    step = predict_candidate(candidate=candidate, model=llama.model, hardware=llama.hardware, training=llama.training)
    # 989 TFLOP/s bf16 dense (H100 SXM datasheet) × 0.4 efficiency × 8 GPUs / the hand-counted FLOPs per token
    compute_only = 989e12 * 0.4 * 8 / LLAMA_2_7B_TRAINING_FLOPS_PER_TOKEN  # ≈ 73,831 tokens/s
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
    truth = Rates(seconds_per=(2e-9, 1e-9, 3e-9, 4e-9, 1e-8, 5e-8, 0.0, 0.004, 0.01, 0.02, 0.05, 1e-10), source="truth",
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
