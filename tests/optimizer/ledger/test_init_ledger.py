"""The init phase and training.model_init: parsing, constraints, and what the ledger says for big models."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from optimizer.ledger.core import Phase, compute_ledger, evaluate
from optimizer.ledger.transformer import parameter_count
from optimizer.study.errors import UserError
from optimizer.study.knobs import FullCheckpointing, OffloadDevice, Precision, ZeroStage
from optimizer.study.search_space import parse_search_space
from optimizer.study.specs import Construction, ModelInit, baseline_candidate, construction_for
from optimizer.study.study_file import load_study


def _with_init(study, model_init: str):
    return dataclasses.replace(study.training, model_init=ModelInit(model_init))


def test_auto_is_zero_init_at_stage_3_and_the_device_below():
    assert construction_for(ModelInit.AUTO, ZeroStage.PARAMETERS) is Construction.ZERO_INIT
    assert {construction_for(ModelInit.AUTO, s) for s in (ZeroStage.DISABLED, ZeroStage.GRADIENTS)} == \
        {Construction.DEVICE}
    assert construction_for(ModelInit.FULL, ZeroStage.PARAMETERS) is Construction.FULL
    with pytest.raises(ValueError, match="zero_stage 2"):
        construction_for(ModelInit.ZERO_INIT, ZeroStage.GRADIENTS)


def _write(tmp_path, repo_root, **training):
    raw = yaml.safe_load((repo_root / "studies" / "cpu-tiny.yaml").read_text())
    raw["training"].update(training)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, raw


def test_model_init_is_checked_in_the_study_file(tmp_path, repo_root):
    path, _ = _write(tmp_path, repo_root, model_init="meta")
    with pytest.raises(UserError, match=r"training\.model_init.*auto, zero_init, device, full"):
        load_study(path)
    path, raw = _write(tmp_path, repo_root, model_init="zero_init")
    raw["search_space"]["knobs"]["zero_stage"] = [1, 2]
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match=r"training\.model_init.*only ZeRO stage 3"):
        load_study(path)


def test_zero_init_below_stage_3_is_an_invalid_candidate_with_its_reason(tmp_path, repo_root):
    path, _ = _write(tmp_path, repo_root, model_init="zero_init")
    study = load_study(path)
    verdict = evaluate(candidate=baseline_candidate(study.training), model=study.model, hardware=study.hardware,
                       training=study.training)
    assert verdict.ledger is None and any("zero_init" in r for r in verdict.invalid_reasons)


def _candidates(study):
    space = parse_search_space({"knobs": {"zero_stage": [0, 1, 2, 3], "offload_optimizer": ["none", "cpu", "nvme"],
                                          "offload_param": ["none", "cpu", "nvme"], "precision": ["bf16"],
                                          "checkpointing": ["full"], "micro_batch_size": [1]}}, source="test")
    return list(space.candidates(baseline_candidate(study.training)))


def test_llama_70b_on_8_h100_fits_only_at_zero_3_with_offload(repo_root):
    study = load_study(repo_root / "studies" / "llama-70b-8xh100.yaml")
    fits = [v.candidate for c in _candidates(study)
            for v in [evaluate(candidate=c, model=study.model, hardware=study.hardware, training=study.training)]
            if v.fits]
    assert fits and all(c.zero_stage is ZeroStage.PARAMETERS for c in fits)
    assert all((c.offload_optimizer, c.offload_param) != (OffloadDevice.NONE,) * 2 for c in fits)
    # Built the old way (the whole FP32 model on every rank's host, moved to the device), nothing fits:
    # 70e9 x 2 bytes on one 80 GB device.
    full = _with_init(study, "full")
    assert not any(evaluate(candidate=c, model=study.model, hardware=study.hardware, training=full).fits
                   for c in _candidates(study))


# Llama-2-70B by hand (studies/llama-70b-8xh100.yaml): per block q, o 8192² = 67,108,864 each, k, v 8192·1024 =
# 8,388,608 each (8 KV heads of 128), gate, up, down 8192·28672 = 234,881,024 each, two RMSNorms 8192 each:
# 855,654,400; × 80 blocks = 68,452,352,000; + embedding and untied head 2·32000·8192 = 524,288,000 + final norm 8192.
PSI_70B = 68_976_648_192
# ZeRO-3 in bf16 (g = 2) on N = 8 ranks, built under zero.Init (model_init auto at stage 3), symbols as in
# optimizer/ledger/init_phase.py's docstring: every tensor divides by 8, so Q = Ψ/8 = 8,622,081,024;
# S = min(Q, sub_group_size 1e9) = 1e9; B = reduce bucket h² = 67,108,864; LL = the embedding (or head) 262,144,000.
# The device holds, per moment (the optimizer on cpu/nvme takes 4Q and 4S to the host, the parameters on cpu/nvme 2Q):
#   construction 2Q + 4LL;  defragment 2Q + 4Q + 2B + 4LL;  set-up 2Q + 4Q + 2B + 4S.
INIT_70B = {  # (offload_optimizer, offload_param) → init bytes on the device, the largest of the three moments
    ("none", "none"): 17_244_162_048 + 34_488_324_096 + 134_217_728 + 4_000_000_000,  # set-up: 55,866,703,872
    ("none", "cpu"): 34_488_324_096 + 134_217_728 + 4_000_000_000,  # set-up, 4Q + 2B + 4S: 38,622,541,824
    ("none", "nvme"): 34_488_324_096 + 134_217_728 + 4_000_000_000,
    ("cpu", "none"): 17_244_162_048 + 134_217_728 + 1_048_576_000,  # defragment, 2Q + 2B + 4LL: 18,426,955,776
    ("nvme", "none"): 17_244_162_048 + 134_217_728 + 1_048_576_000,
    **{(opt, param): 134_217_728 + 1_048_576_000  # defragment, 2B + 4LL: 1,182,793,728
       for opt in ("cpu", "nvme") for param in ("cpu", "nvme")},
}


def test_zero_init_keeps_the_init_phase_below_the_training_peak_at_70b(repo_root):
    study = load_study(repo_root / "studies" / "llama-70b-8xh100.yaml")
    init = {}
    for candidate in _candidates(study):
        verdict = evaluate(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)
        if verdict.ledger is not None and candidate.zero_stage is ZeroStage.PARAMETERS:
            assert verdict.ledger.peak_phase is not Phase.INIT, candidate.label()
            init[(candidate.offload_optimizer.value, candidate.offload_param.value)] = verdict.ledger.init_bytes
    assert init == INIT_70B
    assert max(INIT_70B.values()) < 2 * PSI_70B  # never the whole bf16 model (137,953,296,384 bytes)


# Llama-2-7B by hand (studies/llama-7b-8xh100.yaml): per block q, k, v, o 4096² = 16,777,216 each, gate, up, down
# 4096·11008 = 45,088,768 each, two RMSNorms 4096 each: 202,383,360; × 32 blocks = 6,476,267,520; + embedding and
# untied head 2·32000·4096 = 262,144,000 + final norm 4096. The largest tensor Lₜ is the embedding, 131,072,000.
PSI_7B = 6_738_415_616
LT_7B = 131_072_000


@pytest.mark.parametrize(("study", "psi"), [("llama-70b-8xh100", PSI_70B), ("llama-7b-8xh100", PSI_7B)])
def test_the_ledgers_parameter_count_is_the_one_worked_by_hand(repo_root, study, psi):
    assert parameter_count(load_study(repo_root / "studies" / f"{study}.yaml").model) == psi


def test_a_7b_full_fine_tune_in_plain_data_parallel_does_not_fit(repo_root):
    study = load_study(repo_root / "studies" / "llama-7b-8xh100.yaml")
    base = dataclasses.replace(baseline_candidate(study.training), precision=Precision.BF16,
                               checkpointing=FullCheckpointing())
    ledger = compute_ledger(candidate=base, model=study.model, hardware=study.hardware, training=study.training)
    # Stage 0 in bf16 (optimizer/ledger/model_states.py _stage0), peaking in the optimizer step: bf16 parameters
    # and gradients 2Ψ + 2Ψ, Adam's two FP32 states 8Ψ, the FP32 master 4Ψ, and the step's FP32 gradient list and
    # flat copy 8Ψ (fused_optimizer.py:285-288); no activations or buffers live then. 24Ψ in all, the ZeRO paper's
    # 16Ψ of model states and 8Ψ more.
    assert not ledger.fits and ledger.per_gpu() == {
        "params": 2 * PSI_7B, "grads": (2 + 8) * PSI_7B, "optimizer": 8 * PSI_7B, "master_weights": 4 * PSI_7B,
        "activations": 0, "buffers": 0, "total": 24 * PSI_7B}  # 161,721,974,784 bytes > 80 GiB


def test_full_construction_holds_the_fp32_model_on_the_host(repo_root):
    study = load_study(repo_root / "studies" / "llama-7b-8xh100.yaml")
    candidate = dataclasses.replace(baseline_candidate(study.training), zero_stage=ZeroStage.GRADIENTS,
                                    precision=Precision.BF16)
    host = {}
    for model_init in ("full", "device"):
        ledger = compute_ledger(candidate=candidate, model=study.model, hardware=study.hardware,
                                training=_with_init(study, model_init))
        host[model_init] = sum(i.bytes for i in ledger.items if i.phase is Phase.INIT and i.location.value == "host")
    # full: the FP32 model 4Ψ and, while deepspeed.initialize casts it tensor by tensor, the largest tensor's bf16 copy
    # 2Lₜ (engine.py:1859-1862): 26,953,662,464 + 262,144,000. device: built on the device, nothing on the host.
    assert host == {"full": 4 * PSI_7B + 2 * LT_7B, "device": 0}  # 27,215,806,464 bytes


def test_the_launch_limit_follows_the_predicted_step():
    from optimizer.study.trial_settings import TrialSettings

    settings = TrialSettings(timeout_s=300.0, warmup_steps=2, measured_steps=3)
    assert settings.timeout_for(None) == 300.0  # no prediction: the floor
    assert settings.timeout_for(1.0) == 300.0  # short steps: the floor
    assert settings.timeout_for(600.0) == 3.0 * (2 + 3 + 2) * 600.0  # a 70B step of 10 minutes: 3.5 hours


def test_a_big_models_fp32_reference_is_the_fastest_fitting_variant(repo_root):
    from launchers.trial.run import predicted_step_s, reference_candidate

    study = load_study(repo_root / "studies" / "llama-70b-8xh100.yaml")
    chosen = reference_candidate(study)
    verdict = evaluate(candidate=chosen, model=study.model, hardware=study.hardware, training=study.training)
    assert chosen.precision is Precision.FP32 and verdict.fits
    slowest_fitting = dataclasses.replace(chosen, offload_param=OffloadDevice.CPU, offload_optimizer=OffloadDevice.CPU)
    assert evaluate(candidate=slowest_fitting, model=study.model, hardware=study.hardware,
                    training=study.training).fits
    assert predicted_step_s(study, chosen) < predicted_step_s(study, slowest_fitting)


def test_zero_offload_papers_13b_on_one_v100_fits():
    """Ren et al. (ATC'21): a 13B model trains on one 32 GB V100 with ZeRO-2 and the optimizer on the CPU. The
    parameters do not fit twice on the device, so DeepSpeed flattens them on the host (stage_1_and_2.py:441-521)."""
    from optimizer.study.specs import HardwareSpec, TrainingSpec, TransformerModel

    model = TransformerModel(layers=40, hidden_size=5120, heads=40, kv_heads=40, ffn_size=20480, vocab_size=50257,
                             max_positions=1024)
    hardware = HardwareSpec(gpus_per_node=1, gpu_memory_bytes=32 * 2**30, device_reserve_bytes=2**30,
                            allocator_overhead=0.12, host_memory_bytes=1_500_000_000_000,
                            supported_precisions=(Precision.FP32, Precision.FP16))
    training = TrainingSpec(global_batch_size=1, micro_batch_size=1, sequence_length=1024)
    candidate = dataclasses.replace(baseline_candidate(training), zero_stage=ZeroStage.GRADIENTS,
                                    offload_optimizer=OffloadDevice.CPU, precision=Precision.FP16,
                                    checkpointing=FullCheckpointing())
    ledger = compute_ledger(candidate=candidate, model=model, hardware=hardware, training=training)
    assert ledger.fits, ledger.verdict_reasons()
    # Ψ by hand (GPT-2 block: LayerNorms with bias, biased linears, learned positions, tied head): per block two
    # LayerNorms 2·2·5120 = 20,480, q, k, v, o 4·(5120² + 5120) = 104,878,080, fc 5120·20480 + 20480 = 104,878,080,
    # proj 20480·5120 + 5120 = 104,862,720: 314,639,360; × 40 = 12,585,574,400; + tokens 50257·5120 = 257,315,840
    # (Lₜ, the largest tensor) + positions 1024·5120 = 5,242,880 + final LayerNorm 10,240 = 12,848,143,360.
    # One rank: Ψ₁₂ = Ψ (even). 31 GiB usable − 2Ψ leaves no room for the 2Ψ₁₂ flat copy, so the flattening is on
    # the host (stage_1_and_2.py:441-451) and the device's init peak is the flat copy moved over plus the offload's
    # two gradient buffers (:653-661): 2Ψ₁₂ + 2·2Lₜ = 25,696,286,720 + 1,029,263,360 — less than 2·2Ψ: the device
    # never holds the fp16 parameters twice.
    assert ledger.init_bytes == 2 * 12_848_143_360 + 2 * 2 * 257_315_840  # 26,725,550,080
