"""One device type's figures for the throughput model and the study's checks (a typed value, pure).

The built-in profiles, each with its datasheet, are in :mod:`optimizer.study.hardware_profiles`; a study names one
or gives its own figures (``hardware.profile``, :mod:`optimizer.study.hardware_section`). The value lives here,
with the specs, because :class:`~optimizer.study.specs.HardwareSpec` carries the resolved profile.

Rates are per device and per direction: ``link_bytes_per_s`` is the bus bandwidth one device sustains in a ring
collective inside a node (half the NVLink bidirectional figure, or a PCIe peer link), ``inter_node_bytes_per_s``
the network bandwidth per device between nodes (cluster-specific: give ``hardware.inter_node_bandwidth``).
A figure nobody published is ``None`` and the model says "unknown" for whatever needs it (nanochat's rule).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from optimizer.study.knobs import Precision


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    """One device type's figures (None: unknown)."""

    name: str
    """The profile's name (``hardware.profile``), or the name a study's own figures go by."""
    peak_flops: tuple[tuple[Precision, float | None], ...]
    """Dense peak FLOP/s per device by training precision (fp32: no TF32 — PyTorch's default for matmuls;
    16-bit: tensor cores with FP32 accumulation, as training uses them); a precision the device lacks is absent."""
    link_bytes_per_s: float | None
    """Intra-node collective bandwidth per device, one direction (bytes/s): NVLink, or the PCIe peer link."""
    inter_node_bytes_per_s: float | None
    """Inter-node bandwidth per device, one direction (bytes/s); None: give it in the study."""
    pcie_bytes_per_s: float | None
    """Host↔device bandwidth per device, one direction (bytes/s)."""
    host_adam_params_per_s: float | None
    """Parameters per second DeepSpeedCPUAdam updates for one rank on the node's host."""
    precisions: tuple[Precision, ...] = (Precision.FP32, Precision.BF16, Precision.FP16)
    """The training precisions the device has (a V100 has no bf16)."""
    memory_bytes: int | None = None
    """Device memory as the datasheet names it (bytes; NVIDIA's "80 GB" parts hold 80 GiB of HBM); None: any."""
    memory_bytes_per_s: float | None = None
    """Device memory (HBM or GDDR) bandwidth (bytes/s)."""
    efficiency: float = 0.4
    """Achieved fraction of peak FLOP/s (MFU) assumed before calibration: 35–45 % is typical for dense
    transformer training (Llama 3 405B 38–43 %; MegaScale 55 % on A100) — docs/sources.md."""
    device_pattern: str | None = None
    """A regular expression matching ``torch.cuda.get_device_name()`` of this device, case-insensitive (None: the
    profile names no device, e.g. a study's own figures without ``base``)."""
    sources: tuple[str, ...] = field(default=())
    """Where the figures come from."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "precisions", tuple(Precision(p) for p in self.precisions))
        object.__setattr__(self, "peak_flops", tuple((Precision(p), f) for p, f in self.peak_flops))
        if not self.precisions:
            raise ValueError(f"profile {self.name}: precisions must name at least one precision")
        extra = [p.value for p, f in self.peak_flops if f is not None and p not in self.precisions]
        if extra:
            raise ValueError(f"profile {self.name}: a FLOP/s figure for {', '.join(extra)}, which is not among "
                             f"its precisions ({', '.join(p.value for p in self.precisions)})")
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"profile {self.name}: efficiency must be in (0, 1], got {self.efficiency}")

    def flops(self, precision: Precision) -> float | None:
        """Peak FLOP/s for ``precision`` (None: unknown, or the device lacks it)."""
        return dict(self.peak_flops).get(precision)

    def names_device(self, device_name: str) -> bool | None:
        """Whether ``device_name`` (``torch.cuda.get_device_name()``) is this profile's device; None: the profile
        names no device."""
        if self.device_pattern is None:
            return None
        return re.search(self.device_pattern, device_name, flags=re.IGNORECASE) is not None
