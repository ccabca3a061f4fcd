"""Hardware profiles against their datasheets, a study's own figures, memory units, the CUDA defaults and the
device a trial ran on. Expected figures are worked from the datasheets by hand (docs/sources.md), not recomputed
by the code."""

from __future__ import annotations

import textwrap

import pytest
from trial_fixtures import rank_report

from launchers.measure.device_identity import device_identity
from launchers.study.study_run import say_profile_mismatch
from launchers.trial.run import result_json
from optimizer.ledger.transformer import parameter_count
from optimizer.perf.throughput import StepTime, predict_candidate, work
from optimizer.results.trial_result import summarize
from optimizer.study.constraints import invalid_reasons
from optimizer.study.errors import UserError
from optimizer.study.hardware_profiles import PROFILES, profile_for_device, profile_mismatch, profile_named
from optimizer.study.knobs import Precision, with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study
from optimizer.study.units import format_bytes

GiB = 2**30
FP32, BF16, FP16 = Precision.FP32, Precision.BF16, Precision.FP16

STUDY = """
name: gpus
model: {{kind: transformer, layers: 4, hidden_size: 512, heads: 8, vocab_size: 32000}}
hardware:
  accelerator: cuda
  gpus_per_node: 8
  gpu_memory: {memory}
{extra}training: {{global_batch_size: 64, micro_batch_size: 8, sequence_length: 512}}
search_space: {{knobs: {{zero_stage: [0, 1], precision: [fp32, bf16, fp16]}}}}
"""


def _study(tmp_path, *, memory="32 GiB", **hardware):
    extra = "".join(f"  {key}: {value}\n" for key, value in hardware.items())
    path = tmp_path / "gpus.yaml"
    path.write_text(textwrap.dedent(STUDY.format(memory=memory, extra=extra)))
    return load_study(path)


def _candidate(study, **knobs):
    return with_knobs(baseline_candidate(study.training), knobs)


# --- the built-in profiles, figure by figure from the datasheets (dense; one direction) ---

DATASHEETS = {  # name: (bf16, fp16, fp32 FLOP/s, memory bandwidth, intra-node link, host PCIe, memory GiB)
    "v100-16gb": (None, 125e12, 15.7e12, 900e9, 150e9, 16e9, 16),  # NVLink 2 300 GB/s both ways; PCIe Gen3
    "v100-32gb": (None, 125e12, 15.7e12, 900e9, 150e9, 16e9, 32),
    "a10g-24gb": (70e12, 70e12, 31.2e12, 600e9, 32e9, 32e9, 24),  # no NVLink: peers over PCIe Gen4
    "l4-24gb": (121e12, 121e12, 30.3e12, 300e9, 32e9, 32e9, 24),  # 242 "with sparsity" / 2
    "l40s-48gb": (362.05e12, 362.05e12, 91.6e12, 864e9, 32e9, 32e9, 48),
    "rtx3090-24gb": (71e12, 71e12, 35.6e12, 936e9, 32e9, 32e9, 24),  # FP32 accumulate: half the FP16-acc. rate
    "rtx4090-24gb": (165.2e12, 165.2e12, 82.6e12, 1008e9, 32e9, 32e9, 24),
    "a100-40gb": (312e12, 312e12, 19.5e12, 1555e9, 300e9, 32e9, 40),  # NVLink 3 600 GB/s both ways
    "a100-80gb": (312e12, 312e12, 19.5e12, 2039e9, 300e9, 32e9, 80),
    "h100-80gb": (989e12, 989e12, 67e12, 3.35e12, 450e9, 64e9, 80),  # SXM; NVLink 4 900 GB/s both ways; Gen5
    "h100-sxm-80gb": (989e12, 989e12, 67e12, 3.35e12, 450e9, 64e9, 80),
    "h100-pcie-80gb": (756e12, 756e12, 51e12, 2.0e12, 64e9, 64e9, 80),  # 1,513 "with sparsity" / 2
    "h200-141gb": (989e12, 989e12, 67e12, 4.8e12, 450e9, 64e9, 141),
}


@pytest.mark.parametrize("name", sorted(DATASHEETS))
def test_every_gpu_profile_holds_its_datasheet_figures(name):
    bf16, fp16, fp32, hbm, link, pcie, memory_gib = DATASHEETS[name]
    profile = profile_named(name)
    assert (profile.flops(BF16), profile.flops(FP16), profile.flops(FP32)) == (bf16, fp16, fp32)
    assert (profile.memory_bytes_per_s, profile.link_bytes_per_s, profile.pcie_bytes_per_s) == (hbm, link, pcie)
    assert profile.memory_bytes == memory_gib * GiB
    assert (BF16 in profile.precisions) is (bf16 is not None)
    assert any(word in profile.sources[0] for word in ("datasheet", "whitepaper", "AWS EC2"))


def test_the_old_names_still_resolve():
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "cpu"):
        assert profile_named(name).name == name
    assert set(DATASHEETS) | {"cpu"} == set(PROFILES)
    with pytest.raises(ValueError, match="known: a100-40gb"):
        profile_named("b200")


# --- a V100 study: known speeds, and no bf16 ---

def test_a_v100_study_plans_with_its_datasheet_speeds(tmp_path):
    study = _study(tmp_path, profile="v100-32gb")
    assert study.hardware.supported_precisions == (FP32, FP16)  # the profile's, when not stated
    fp16 = _candidate(study, zero_stage=1, precision="fp16")  # 64 / (8 × 8): one micro-step
    step = predict_candidate(candidate=fp16, model=study.model, hardware=study.hardware, training=study.training)
    assert isinstance(step, StepTime)
    job = work(candidate=fp16, model=study.model, hardware=study.hardware, training=study.training)
    terms = dict(step.terms_s)
    assert terms["compute"] == pytest.approx(job.flops / (125e12 * 0.4))  # tensor-core fp16 at the 0.4 prior
    psi = parameter_count(study.model)
    # ZeRO-1 all-reduces the fp16 gradients: 2 ring passes of 7/8 · Ψ · 2 bytes at 150 GB/s (NVLink 2, one way).
    assert terms["communication"] == pytest.approx(2 * 7 / 8 * psi * 2 / 150e9)
    fp32 = _candidate(study, zero_stage=1, precision="fp32")
    step32 = predict_candidate(candidate=fp32, model=study.model, hardware=study.hardware, training=study.training)
    assert isinstance(step32, StepTime)
    assert dict(step32.terms_s)["compute"] == pytest.approx(job.flops / (15.7e12 * 0.4))


def test_bf16_on_a_v100_is_invalid_with_the_profile_as_the_reason(tmp_path):
    study = _study(tmp_path, profile="v100-32gb")
    reasons = invalid_reasons(candidate=_candidate(study, precision="bf16"), model=study.model,
                              hardware=study.hardware, training=study.training)
    assert reasons == ("precision=bf16 is not supported by the v100-32gb profile "
                       "(hardware.supported_precisions: fp32, fp16)",)
    assert not invalid_reasons(candidate=_candidate(study, precision="fp16"), model=study.model,
                               hardware=study.hardware, training=study.training)


def test_stating_a_precision_the_profile_lacks_names_both_keys(tmp_path):
    with pytest.raises(UserError) as err:
        _study(tmp_path, profile="v100-16gb", memory="16 GiB", supported_precisions="[fp32, bf16]")
    assert err.value.key == "hardware.supported_precisions"
    assert "bf16 is not a precision of the v100-16gb profile (hardware.profile has fp32, fp16)" in err.value.why


def test_more_memory_than_the_profile_device_is_refused_less_is_a_budget(tmp_path):
    with pytest.raises(UserError) as err:
        _study(tmp_path, profile="v100-16gb", memory="32 GiB")
    assert err.value.key == "hardware.gpu_memory"
    # 32 GiB = 34,359,738,368 B = 34.36 GB; 16 GiB = 17,179,869,184 B = 17.18 GB
    assert err.value.why.startswith("32.00 GiB (34.36 GB) is more than the v100-16gb device has "
                                    "(16.00 GiB (17.18 GB), hardware.profile)")
    assert _study(tmp_path, profile="v100-16gb", memory="15 GiB").hardware.gpu_memory_bytes == 15 * GiB
    assert _study(tmp_path, profile="a100-80gb", memory="80 GB").hardware.gpu_memory_bytes == 80 * 10**9


# --- a study's own figures ---

def test_a_doubled_bf16_rate_halves_the_compute_term(tmp_path):
    named = _study(tmp_path, memory="80 GiB", profile="a100-80gb")
    own = _study(tmp_path, memory="80 GiB", profile="{base: a100-80gb, flops: {bf16: 624 TFLOP/s}}")
    assert own.hardware.profile.name == "a100-80gb (custom)"
    assert own.hardware.profile.flops(BF16) == 624e12 and own.hardware.profile.flops(FP32) == 19.5e12  # kept
    candidate = _candidate(named, zero_stage=1, precision="bf16")
    steps = [predict_candidate(candidate=candidate, model=s.model, hardware=s.hardware, training=s.training)
             for s in (named, own)]
    assert all(isinstance(s, StepTime) for s in steps)
    assert dict(steps[1].terms_s)["compute"] == pytest.approx(dict(steps[0].terms_s)["compute"] / 2)
    assert dict(steps[1].terms_s)["communication"] == pytest.approx(dict(steps[0].terms_s)["communication"])


def test_a_profile_of_the_studys_own_figures_without_base(tmp_path):
    study = _study(tmp_path, memory="24 GB", profile=(
        "{flops: {fp16: 100 TFLOP/s, fp32: 20 TFLOP/s}, link_bandwidth: 25 GB/s, host_bandwidth: 25 GB/s, "
        "memory_bandwidth: 1 TB/s, memory: 24 GB, efficiency: 0.5}"))
    profile = study.hardware.profile
    assert profile.name == "custom" and profile.precisions == (FP32, FP16)
    assert study.hardware.supported_precisions == (FP32, FP16)
    assert (profile.link_bytes_per_s, profile.pcie_bytes_per_s, profile.memory_bytes_per_s) == (25e9, 25e9, 1e12)
    assert profile.memory_bytes == 24 * 10**9 and profile.efficiency == 0.5
    step = predict_candidate(candidate=_candidate(study, precision="fp16"), model=study.model,
                             hardware=study.hardware, training=study.training)
    job = work(candidate=_candidate(study, precision="fp16"), model=study.model, hardware=study.hardware,
               training=study.training)
    assert isinstance(step, StepTime) and dict(step.terms_s)["compute"] == pytest.approx(job.flops / 50e12)


@pytest.mark.parametrize(("profile", "key", "why"), [
    ("{flops: {bf16: 312 TFLOPS}}", "hardware.profile.flops.bf16", "expected a FLOP rate with its unit"),
    ("{flops: {bf16: 312}}", "hardware.profile.flops.bf16", "such as '312 TFLOP/s'"),
    ("{flops: {tf32: 156 TFLOP/s}}", "hardware.profile.flops.tf32", "unknown key"),
    ("{base: a100-80gb, link_bandwidth: 300}", "hardware.profile.link_bandwidth", "'50 GB/s'"),
    ("{base: a100-80gb, hbm: 2 TB/s}", "hardware.profile.hbm", "unknown key"),
    ("{base: b200}", "hardware.profile.base", "unknown hardware profile"),
    ("{link_bandwidth: 300 GB/s}", "hardware.profile.flops", "needs flops per precision"),
    ("{flops: {bf16: 1 PFLOP/s}, precisions: [fp32]}", "hardware.profile.flops.bf16",
     "bf16 is not in hardware.profile.precisions (fp32)"),
    ("{base: a100-80gb, efficiency: 1.5}", "hardware.profile.efficiency", "(0, 1]"),
    ("[a100-80gb]", "hardware.profile", "expected a profile name"),
])
def test_a_bad_profile_mapping_names_the_dotted_key(tmp_path, profile, key, why):
    with pytest.raises(UserError) as err:
        _study(tmp_path, memory="24 GB", profile=profile)
    assert err.value.key == key and why in err.value.why


# --- memory units and the CUDA defaults ---

@pytest.mark.parametrize("bare", ["80", "80.0", "'80'"])
def test_a_bare_gpu_memory_is_refused_with_the_fix(tmp_path, bare):
    with pytest.raises(UserError) as err:
        _study(tmp_path, memory=bare)
    assert err.value.key == "hardware.gpu_memory"
    number = bare.strip("'")
    assert err.value.why == f'{number} has no unit; write "{number} GiB" (2^30 bytes) or "{number} GB" (10^9 bytes)'


def test_cuda_defaults_apply_and_are_marked_default(tmp_path):
    study = _study(tmp_path)
    hardware = study.hardware
    assert hardware.device_reserve_bytes == GiB and not hardware.device_reserve_stated
    assert hardware.allocator_overhead == 0.12 and not hardware.allocator_overhead_stated
    assert hardware.binary_units  # gpu_memory: 32 GiB
    stated = _study(tmp_path, memory="24 GB", device_reserve="0 GB", allocator_overhead=0).hardware
    assert stated.device_reserve_bytes == 0 and stated.device_reserve_stated
    assert stated.allocator_overhead == 0.0 and stated.allocator_overhead_stated
    assert not stated.binary_units  # gpu_memory: 24 GB


def test_the_cuda_default_reserve_on_a_tiny_device_says_it_was_the_default(tmp_path):
    with pytest.raises(UserError) as err:
        _study(tmp_path, memory="512 MiB")
    assert err.value.key == "hardware.device_reserve" and "not stated, so the CUDA default 1 GiB" in err.value.why


# --- format_bytes, worked by hand ---

@pytest.mark.parametrize(("num_bytes", "binary", "text"), [
    (80 * 2**30, True, "80.00 GiB (85.90 GB)"),  # 85,899,345,920 B
    (3 * 10**6, False, "3.00 MB (2.86 MiB)"),  # 3,000,000 / 1,048,576 = 2.861
    (24 * 10**9, False, "24.00 GB (22.35 GiB)"),  # 24e9 / 1,073,741,824 = 22.352
    (3 * 2**39, True, "1.50 TiB (1.65 TB)"),  # 1,649,267,441,664 B
    (0, True, "0 B"),
    (0, False, "0 B"),
    (512, False, "512 B"),
])
def test_format_bytes(num_bytes, binary, text):
    assert format_bytes(num_bytes, binary=binary) == text


# --- the device a trial ran on ---

H100_SXM = ("NVIDIA H100 80GB HBM3", 85_029_158_912)  # 79.19 GiB: what torch reports on an H100 SXM
A100_40 = ("NVIDIA A100-SXM4-40GB", 42_505_273_344)  # 39.59 GiB
V100_16 = ("Tesla V100-SXM2-16GB", 16_945_512_448)  # 15.78 GiB


def test_a_matching_device_says_nothing():
    assert profile_mismatch(profile_named("h100-80gb"), *H100_SXM) is None
    assert profile_mismatch(profile_named("a100-40gb"), *A100_40) is None
    assert profile_mismatch(profile_named("v100-16gb"), *V100_16) is None
    assert profile_mismatch(profile_named("l4-24gb"), "NVIDIA L4", 23_580_639_232) is None
    assert profile_mismatch(profile_named("cpu"), None, None) is None


def test_the_mismatch_message_names_both_and_the_right_profile():
    why = profile_mismatch(profile_named("a100-80gb"), *H100_SXM)
    assert why is not None
    assert why.startswith("the study's profile is a100-80gb but the trials run on 'NVIDIA H100 80GB HBM3' (79.2 GiB)")
    assert why.endswith("(give hardware.profile: h100-80gb)")
    assert "hardware.profile: a100-40gb" in profile_mismatch(profile_named("a100-80gb"), *A100_40)  # memory tells
    assert "hardware.profile: v100-16gb" in profile_mismatch(profile_named("v100-32gb"), *V100_16)
    assert "h100-pcie-80gb" in profile_mismatch(profile_named("h100-80gb"), "NVIDIA H100 PCIe", 85_029_158_912)
    assert profile_mismatch(profile_named("l4-24gb"), "NVIDIA L40S", 47_697_362_944) is not None
    assert "CPU ranks" in profile_mismatch(profile_named("h100-80gb"), None, None)
    assert profile_for_device("NVIDIA GeForce RTX 4090", 25_386_352_640).name == "rtx4090-24gb"


def test_the_rank_reports_device_reaches_the_result_its_json_and_one_warning(tmp_path, capsys):
    name, total = H100_SXM
    reports = {r: rank_report(r, device_name=name, device_total_bytes=total) for r in (0, 1)}
    result = summarize(rank_reports=reports, world_size=2, returncode=0, timed_out=False, tokens_per_step=1,
                       reference_losses=None, log_tail="", wall_s=1.0)
    assert (result.device_name, result.device_total_bytes) == (name, total)
    assert result_json(result)["device_name"] == name and result_json(result)["device_total_bytes"] == total
    crashed = summarize(rank_reports={0: {"rank": 0, "status": "oom", "device_name": name,
                                          "device_total_bytes": total}},
                        world_size=2, returncode=1, timed_out=False, tokens_per_step=1, reference_losses=None,
                        log_tail="", wall_s=1.0)
    assert crashed.device_name == name  # a failed trial says where it failed too
    cpu = summarize(rank_reports={0: rank_report(0), 1: rank_report(1)}, world_size=2, returncode=0,
                    timed_out=False, tokens_per_step=1, reference_losses=None, log_tail="", wall_s=1.0)
    assert cpu.device_name is None and cpu.device_total_bytes is None
    study = _study(tmp_path, memory="80 GiB", profile="a100-80gb")
    said: list[str] = []
    for _ in range(3):
        say_profile_mismatch(study, result, said=said, worker="w1")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[w1] warning: the study's profile is a100-80gb but the trials run on")


def test_device_identity_on_cpu_and_on_a_stubbed_cuda(monkeypatch):
    import torch

    assert device_identity(cuda=False) == {"device_name": None, "device_total_bytes": None}

    class Properties:
        total_memory = 85_029_158_912

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    assert device_identity(cuda=True) == {"device_name": "NVIDIA H100 80GB HBM3",
                                          "device_total_bytes": 85_029_158_912}
