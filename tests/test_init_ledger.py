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


def test_zero_init_keeps_the_init_phase_below_the_training_peak_at_70b(repo_root):
    study = load_study(repo_root / "studies" / "llama-70b-8xh100.yaml")
    for candidate in _candidates(study):
        verdict = evaluate(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)
        if verdict.ledger is not None and candidate.zero_stage is ZeroStage.PARAMETERS:
            assert verdict.ledger.peak_phase is not Phase.INIT, candidate.label()
            assert verdict.ledger.init_bytes < 2 * parameter_count(study.model)  # never the whole bf16 model


def test_a_7b_full_fine_tune_in_plain_data_parallel_does_not_fit(repo_root):
    study = load_study(repo_root / "studies" / "llama-7b-8xh100.yaml")
    base = dataclasses.replace(baseline_candidate(study.training), precision=Precision.BF16,
                               checkpointing=FullCheckpointing())
    ledger = compute_ledger(candidate=base, model=study.model, hardware=study.hardware, training=study.training)
    assert not ledger.fits and ledger.per_gpu()["total"] > 16 * parameter_count(study.model)


def test_full_construction_holds_the_fp32_model_on_the_host(repo_root):
    study = load_study(repo_root / "studies" / "llama-7b-8xh100.yaml")
    candidate = dataclasses.replace(baseline_candidate(study.training), zero_stage=ZeroStage.GRADIENTS,
                                    precision=Precision.BF16)
    psi = parameter_count(study.model)
    host = {}
    for model_init in ("full", "device"):
        ledger = compute_ledger(candidate=candidate, model=study.model, hardware=study.hardware,
                                training=_with_init(study, model_init))
        host[model_init] = sum(i.bytes for i in ledger.items if i.phase is Phase.INIT and i.location.value == "host")
    assert host["full"] >= 4 * psi and host["device"] == 0


def test_the_launch_limit_follows_the_predicted_step():
    from optimizer.study.trial_settings import TrialSettings

    settings = TrialSettings(timeout_s=300.0, warmup_steps=2, measured_steps=3)
    assert settings.timeout_for(None) == 300.0  # no prediction: the floor
    assert settings.timeout_for(1.0) == 300.0  # short steps: the floor
    assert settings.timeout_for(600.0) == 3.0 * (2 + 3 + 2) * 600.0  # a 70B step of 10 minutes: 3.5 hours


def test_a_big_models_fp32_reference_is_the_fastest_fitting_variant(repo_root):
    from launchers.trial import predicted_step_s, reference_candidate

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
    assert ledger.init_bytes < 2 * 2 * parameter_count(model)  # the device never holds the fp16 parameters twice
