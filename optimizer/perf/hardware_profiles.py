"""Figures of known accelerators for the throughput model, each with its source (pure data).

A figure nobody published for a device is ``None`` and the model says "unknown" for whatever needs it,
rather than guessing (nanochat's rule). Study files name a profile with ``hardware.profile``; without one
the throughput is unknown until calibration (:mod:`optimizer.perf.calibration`) has measurements to fit.

Rates are per device and per direction: ``link_bytes_per_s`` is the bus bandwidth one device sustains in
a ring collective inside a node (half the NVLink bidirectional figure), ``inter_node_bytes_per_s`` the
network bandwidth per device between nodes (cluster-specific: give ``hardware.inter_node_bandwidth``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from optimizer.study.knobs import Precision


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    """One device type's figures (None: unknown)."""

    name: str
    """The profile's name (``hardware.profile``)."""
    peak_flops: tuple[tuple[Precision, float | None], ...]
    """Dense peak FLOP/s per device by training precision (fp32: no TF32 — PyTorch's default for matmuls)."""
    link_bytes_per_s: float | None
    """Intra-node collective bandwidth per device, one direction (bytes/s)."""
    inter_node_bytes_per_s: float | None
    """Inter-node bandwidth per device, one direction (bytes/s); None: give it in the study."""
    pcie_bytes_per_s: float | None
    """Host↔device bandwidth per device, one direction (bytes/s)."""
    host_adam_params_per_s: float | None
    """Parameters per second DeepSpeedCPUAdam updates for one rank on the node's host."""
    efficiency: float = 0.4
    """Achieved fraction of peak FLOP/s (MFU) assumed before calibration: 35–45 % is typical for dense
    transformer training (Llama 3 405B 38–43 %; MegaScale 55 % on A100) — docs/sources.md."""
    sources: tuple[str, ...] = field(default=())
    """Where the figures come from."""

    def flops(self, precision: Precision) -> float | None:
        """Peak FLOP/s for ``precision`` (None: unknown)."""
        return dict(self.peak_flops).get(precision)


_CPU_ADAM = ("host_adam_params_per_s 7e8: derived from DeepSpeed's ZenFlow blog (Qwen2.5-1.5B on 2×A100: "
             "ZeRO-2 240 ms/step, with CPU optimizer offload 1,365 ms → ~1.1 s for ~0.77e9 parameters per rank, "
             "PCIe transfers included); a host-dependent estimate")

_A100 = HardwareProfile(
    name="a100-40gb",
    peak_flops=((Precision.BF16, 312e12), (Precision.FP16, 312e12), (Precision.FP32, 19.5e12)),
    link_bytes_per_s=300e9, inter_node_bytes_per_s=None, pcie_bytes_per_s=32e9, host_adam_params_per_s=7e8,
    sources=("NVIDIA A100 datasheet: 312 TFLOP/s bf16/fp16 dense, 19.5 TFLOP/s fp32, NVLink 3 600 GB/s "
             "bidirectional, PCIe Gen4 x16 (~32 GB/s per direction)", _CPU_ADAM))
_H100 = HardwareProfile(
    name="h100-80gb",
    peak_flops=((Precision.BF16, 989e12), (Precision.FP16, 989e12), (Precision.FP32, 67e12)),
    link_bytes_per_s=450e9, inter_node_bytes_per_s=None, pcie_bytes_per_s=64e9, host_adam_params_per_s=7e8,
    sources=("NVIDIA H100 SXM datasheet: ~989 TFLOP/s bf16/fp16 dense, 67 TFLOP/s fp32, NVLink 4 900 GB/s "
             "bidirectional, PCIe Gen5 x16 ~64 GB/s per direction (docs/sources.md)", _CPU_ADAM))

PROFILES: dict[str, HardwareProfile] = {
    "a100-40gb": _A100,
    "a100-80gb": replace(_A100, name="a100-80gb", sources=("NVIDIA A100 datasheet (SXM 80 GB): the 40 GB part's "
                                                         "compute and links; HBM2e 2.0 TB/s", _CPU_ADAM)),
    "h100-80gb": _H100,
    "h200-141gb": replace(_H100, name="h200-141gb", sources=(
        "NVIDIA H200 datasheet: H100 SXM compute, HBM3e 4.8 TB/s; a lent H200 measured bf16 8192³ matmul "
        "≈ 790 TFLOP/s (docs/sources.md)", _CPU_ADAM)),
    "cpu": HardwareProfile(
        name="cpu",
        peak_flops=((Precision.BF16, None), (Precision.FP16, None), (Precision.FP32, None)),
        link_bytes_per_s=None, inter_node_bytes_per_s=None, pcie_bytes_per_s=None, host_adam_params_per_s=None,
        sources=("CPU ranks: every figure depends on the host (cores, vector units, memory bandwidth) and on "
                 "DeepSpeed's per-step Python overheads, which dominate small models; unknown until calibration "
                 "fits them from the study's own trials",)),
}


def profile_named(name: str) -> HardwareProfile:
    """The profile called ``name``; ValueError listing the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
