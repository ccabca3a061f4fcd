"""Figures of known accelerators for the throughput model, each with its datasheet (pure data).

A figure nobody published for a device is ``None`` and the model says "unknown" for whatever needs it,
rather than guessing (nanochat's rule); a precision the device lacks (bf16 on a V100) is left out of its
``precisions``, so a study on it marks those candidates invalid. Study files name a profile with
``hardware.profile`` or give the figures themselves (:mod:`optimizer.study.hardware_section`); without one the
throughput is unknown until calibration (:mod:`optimizer.perf.calibration`) has measurements to fit.

Conventions, for every profile (docs/sources.md, "Hardware figures", a section per device):

* FLOP/s are dense (NVIDIA prints "with sparsity" figures twice as high beside them); fp32 is the non-tensor
  rate (PyTorch leaves TF32 off for matmuls by default); bf16/fp16 are tensor-core rates with FP32
  accumulation, which training uses (GeForce cards run those at half their FP16-accumulate rate).
* Bandwidths are per device and one direction: NVLink's bidirectional figure halved; a card without NVLink
  talks to its peers over PCIe, so its ``link_bytes_per_s`` is the PCIe figure; PCIe Gen3/4/5 x16 are
  ~16/32/64 GB/s per direction (the datasheets' 32/64/128 GB/s are both directions).
* ``memory_bytes`` is the datasheet's memory: NVIDIA's "80 GB" parts hold 80 GiB of HBM, and
  ``torch.cuda.get_device_properties().total_memory`` reports a little less (ECC, the driver's reserve).

The per-rank CPU Adam rate is the same host-dependent estimate on every GPU profile.
"""

from __future__ import annotations

from dataclasses import replace

from optimizer.study.device_profile import HardwareProfile
from optimizer.study.knobs import Precision
from optimizer.study.units import GiB

__all__ = ["PROFILES", "HardwareProfile", "profile_for_device", "profile_mismatch", "profile_named"]

BF16, FP16, FP32 = Precision.BF16, Precision.FP16, Precision.FP32
NO_BF16 = (FP32, FP16)
"""Volta (V100): fp16 tensor cores, no bf16 — DeepSpeed and PyTorch refuse or emulate bf16 there."""

_CPU_ADAM = ("host_adam_params_per_s 7e8: derived from DeepSpeed's ZenFlow blog (Qwen2.5-1.5B on 2×A100: "
             "ZeRO-2 240 ms/step, with CPU optimizer offload 1,365 ms → ~1.1 s for ~0.77e9 parameters per rank, "
             "PCIe transfers included); a host-dependent estimate")
_PCIE3, _PCIE4, _PCIE5 = 16e9, 32e9, 64e9
"""PCIe x16 per direction: Gen3 ~16 GB/s, Gen4 ~32 GB/s, Gen5 ~64 GB/s (datasheets print both directions)."""


def _gpu(name: str, *, bf16: float | None, fp16: float, fp32: float, memory_gib: int, hbm: float,
         link: float, pcie: float, pattern: str, source: str) -> HardwareProfile:
    flops = ((BF16, bf16), (FP16, fp16), (FP32, fp32)) if bf16 is not None else ((FP16, fp16), (FP32, fp32))
    return HardwareProfile(
        name=name, peak_flops=flops, precisions=(FP32, BF16, FP16) if bf16 is not None else NO_BF16,
        memory_bytes=memory_gib * GiB, memory_bytes_per_s=hbm, link_bytes_per_s=link, inter_node_bytes_per_s=None,
        pcie_bytes_per_s=pcie, host_adam_params_per_s=7e8, device_pattern=pattern, sources=(source, _CPU_ADAM))


_V100 = ("NVIDIA Tesla V100 datasheet (SXM2): 15.7 TFLOP/s fp32, 125 TFLOP/s fp16 tensor, no bf16; HBM2 "
         "900 GB/s; NVLink 2 300 GB/s bidirectional (150 GB/s per direction); PCIe Gen3 x16 32 GB/s (16 per "
         "direction)")
_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (SXM): 19.5 TFLOP/s fp32, 312 TFLOP/s bf16/fp16 dense; HBM2 "
         "1,555 GB/s (40 GB), HBM2e 2,039 GB/s (80 GB); NVLink 3 600 GB/s bidirectional; PCIe Gen4 64 GB/s")
_H100_SXM = ("NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): 67 TFLOP/s fp32, 989 TFLOP/s bf16/fp16 dense "
             "(1,979 with sparsity); HBM3 3.35 TB/s; NVLink 4 900 GB/s bidirectional; PCIe Gen5 128 GB/s")

PROFILES: dict[str, HardwareProfile] = {
    "v100-16gb": _gpu("v100-16gb", bf16=None, fp16=125e12, fp32=15.7e12, memory_gib=16, hbm=900e9, link=150e9,
                      pcie=_PCIE3, pattern=r"v100", source=_V100),
    "v100-32gb": _gpu("v100-32gb", bf16=None, fp16=125e12, fp32=15.7e12, memory_gib=32, hbm=900e9, link=150e9,
                      pcie=_PCIE3, pattern=r"v100", source=_V100),
    "a10g-24gb": _gpu("a10g-24gb", bf16=70e12, fp16=70e12, fp32=31.2e12, memory_gib=24, hbm=600e9, link=_PCIE4,
                      pcie=_PCIE4, pattern=r"\ba10g\b", source=(
                          "AWS EC2 G5 (NVIDIA A10G; no public NVIDIA datasheet): 31.2 TFLOP/s fp32, 70 TFLOP/s "
                          "bf16/fp16 tensor dense, 24 GB GDDR6 600 GB/s (Baseten, 'NVIDIA A10 vs A10G'); no NVLink, "
                          "PCIe Gen4 x16")),
    "l4-24gb": _gpu("l4-24gb", bf16=121e12, fp16=121e12, fp32=30.3e12, memory_gib=24, hbm=300e9, link=_PCIE4,
                    pcie=_PCIE4, pattern=r"\bl4\b", source=(
                        "NVIDIA L4 Tensor Core GPU datasheet: 30.3 TFLOP/s fp32, 242 TFLOP/s bf16/fp16 with "
                        "sparsity (121 dense); 24 GB GDDR6 300 GB/s; no NVLink, PCIe Gen4 x16 64 GB/s")),
    "l40s-48gb": _gpu("l40s-48gb", bf16=362.05e12, fp16=362.05e12, fp32=91.6e12, memory_gib=48, hbm=864e9,
                      link=_PCIE4, pcie=_PCIE4, pattern=r"\bl40s\b", source=(
                          "NVIDIA L40S datasheet: 91.6 TFLOP/s fp32, 362.05 TFLOP/s bf16/fp16 dense (733 with "
                          "sparsity); 48 GB GDDR6 864 GB/s; no NVLink, PCIe Gen4 x16 64 GB/s")),
    "rtx3090-24gb": _gpu("rtx3090-24gb", bf16=71e12, fp16=71e12, fp32=35.6e12, memory_gib=24, hbm=936e9,
                         link=_PCIE4, pcie=_PCIE4, pattern=r"\b3090\b", source=(
                             "NVIDIA Ampere GA102 GPU Architecture whitepaper (GeForce RTX 3090): 35.6 TFLOP/s fp32, "
                             "71 TFLOP/s fp16/bf16 tensor with FP32 accumulate dense; 24 GB GDDR6X 936 GB/s; PCIe "
                             "Gen4 x16 (the optional NVLink bridge, 112.5 GB/s, is not assumed)")),
    "rtx4090-24gb": _gpu("rtx4090-24gb", bf16=165.2e12, fp16=165.2e12, fp32=82.6e12, memory_gib=24, hbm=1008e9,
                         link=_PCIE4, pcie=_PCIE4, pattern=r"\b4090\b", source=(
                             "NVIDIA Ada Lovelace GPU Architecture whitepaper (GeForce RTX 4090): 82.6 TFLOP/s fp32, "
                             "165.2 TFLOP/s fp16/bf16 tensor with FP32 accumulate dense; 24 GB GDDR6X 1,008 GB/s; no "
                             "NVLink, PCIe Gen4 x16 (no peer-to-peer: NCCL goes through host memory, slower)")),
    "a100-40gb": _gpu("a100-40gb", bf16=312e12, fp16=312e12, fp32=19.5e12, memory_gib=40, hbm=1555e9, link=300e9,
                      pcie=_PCIE4, pattern=r"a100", source=_A100),
    "a100-80gb": _gpu("a100-80gb", bf16=312e12, fp16=312e12, fp32=19.5e12, memory_gib=80, hbm=2039e9, link=300e9,
                      pcie=_PCIE4, pattern=r"a100", source=_A100),
    "h100-80gb": _gpu("h100-80gb", bf16=989e12, fp16=989e12, fp32=67e12, memory_gib=80, hbm=3.35e12, link=450e9,
                      pcie=_PCIE5, pattern=r"h100(?!.*(pcie|nvl))", source=_H100_SXM),
    "h100-pcie-80gb": _gpu("h100-pcie-80gb", bf16=756e12, fp16=756e12, fp32=51e12, memory_gib=80, hbm=2.0e12,
                           link=_PCIE5, pcie=_PCIE5, pattern=r"h100.*pcie", source=(
                               "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe): 51 TFLOP/s fp32, 756 TFLOP/s "
                               "bf16/fp16 dense (1,513 with sparsity); HBM2e 2.0 TB/s; PCIe Gen5 128 GB/s (an NVLink "
                               "bridge joins pairs only: peers are assumed on PCIe)")),
    "h200-141gb": _gpu("h200-141gb", bf16=989e12, fp16=989e12, fp32=67e12, memory_gib=141, hbm=4.8e12, link=450e9,
                       pcie=_PCIE5, pattern=r"h200", source=(
                           "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): H100 SXM compute (67 TFLOP/s fp32, "
                           "989 bf16/fp16 dense), 141 GB HBM3e 4.8 TB/s, NVLink 4 900 GB/s, PCIe Gen5 128 GB/s; a "
                           "lent H200 measured bf16 8192³ matmul ≈ 790 TFLOP/s (docs/sources.md)")),
    "cpu": HardwareProfile(
        name="cpu",
        peak_flops=((BF16, None), (FP32, None)), precisions=(FP32, BF16),
        link_bytes_per_s=None, inter_node_bytes_per_s=None, pcie_bytes_per_s=None, host_adam_params_per_s=None,
        sources=("CPU ranks: every figure depends on the host (cores, vector units, memory bandwidth) and on "
                 "DeepSpeed's per-step Python overheads, which dominate small models; unknown until calibration "
                 "fits them from the study's own trials; fp16 left out as DeepSpeed's CPU accelerator refuses it",)),
}
PROFILES["h100-sxm-80gb"] = replace(PROFILES["h100-80gb"], name="h100-sxm-80gb")
"""An alias: ``h100-80gb`` is the SXM part (the name kept from before the PCIe profile existed)."""

MEMORY_SEEN = (0.85, 1.01)
"""A device reporting this share of a profile's ``memory_bytes`` is that profile's memory size: ECC and the
driver take a few percent (an "80 GB" A100 or H100 reports ~79.2 GiB, an L4 ~22 GiB of its 24, an L40S ~44.5 of
its 48), so a 40 GB part under an 80 GB profile (half) is caught while the reserve is not."""


def profile_named(name: str) -> HardwareProfile:
    """The profile called ``name``; ValueError listing the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None


def _memory_matches(profile: HardwareProfile, device_total_bytes: int | None) -> bool:
    if profile.memory_bytes is None or device_total_bytes is None:
        return True
    low, high = MEMORY_SEEN
    return low * profile.memory_bytes <= device_total_bytes <= high * profile.memory_bytes


def profile_for_device(device_name: str, device_total_bytes: int | None) -> HardwareProfile | None:
    """The built-in profile of the device ``torch.cuda.get_device_name()`` calls ``device_name`` with that much
    memory, or None when no profile matches (the first in :data:`PROFILES`' order where several do)."""
    return next((p for p in PROFILES.values()
                 if p.names_device(device_name) and _memory_matches(p, device_total_bytes)), None)


def profile_mismatch(profile: HardwareProfile, device_name: str | None,
                     device_total_bytes: int | None) -> str | None:
    """Why the devices a trial ran on are not the study's ``profile`` — its name's pattern or its memory size
    (:data:`MEMORY_SEEN`) disagree — or None when they match or cannot be compared (a profile of the study's own
    figures names no device). ``device_name`` None: the trial ran on CPU ranks."""
    if device_name is None:
        if profile.device_pattern is None:
            return None
        return f"the study's profile is {profile.name} but the trials run on CPU ranks (no CUDA device)"
    named = profile.names_device(device_name)
    if profile.name == "cpu" or named is False or not _memory_matches(profile, device_total_bytes):
        memory = "" if device_total_bytes is None else f" ({device_total_bytes / GiB:.1f} GiB)"
        better = profile_for_device(device_name, device_total_bytes)
        hint = f"hardware.profile: {better.name}" if better is not None else "a hardware.profile mapping of its figures"
        return (f"the study's profile is {profile.name} but the trials run on {device_name!r}{memory}: its speed "
                f"figures do not describe these devices until calibration corrects them (give {hint})")
    return None
