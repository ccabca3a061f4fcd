"""The study file's ``hardware`` section: the machines, their memory in stated units, and the device's figures
(a built-in profile by name, or the study's own) — every key checked, errors naming the dotted key (pure).

Memory keys need a unit (``gpu_memory: 80`` is refused with the fix: :func:`optimizer.study.units.parse_size`);
bandwidths are ``"50 GB/s"``, FLOP rates ``"312 TFLOP/s"``. A CUDA study that leaves ``device_reserve`` or
``allocator_overhead`` out gets the documented defaults below, marked as defaults on the spec; CPU ranks have
neither a CUDA context nor a caching allocator, so 0.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from optimizer.study import limits
from optimizer.study.device_profile import HardwareProfile
from optimizer.study.fields import (
    DEVICE_BYTES,
    HOST_BYTES,
    Section,
    as_enum,
    as_fraction,
    as_path,
    as_text,
    bytes_within,
    count_within,
    spec_error,
)
from optimizer.study.hardware_profiles import profile_named
from optimizer.study.knobs import Precision
from optimizer.study.specs import Accelerator, HardwareSpec
from optimizer.study.units import GiB, format_bytes, parse_flop_rate, parse_rate, size_family

CUDA_DEVICE_RESERVE_BYTES = 1 * GiB
"""``hardware.device_reserve`` of a CUDA study that does not state it: device memory outside PyTorch's caching
allocator, per GPU. The CUDA context with the kernels PyTorch loads: 287,047,680 bytes with lazy module loading
(PyTorch's default since 1.13, CUDA ≥ 11.7) and 666,632,192 bytes eagerly (PyTorch PR #86509, which made lazy
loading the default; NVIDIA's CUDA Programming Guide, "Lazy Loading": it reduces device memory); NCCL's buffers:
NCCL_BUFFSIZE, 4 MiB by default, per channel and per peer — a ring's two peers over up to 32 channels are
256 MiB (NCCL's environment-variable docs); plus cuBLAS workspaces. 0.67 GB + 0.27 GB ≈ 0.94 GB, rounded up to
1 GiB — the figure studies/llama-7b-8xh100.yaml states. docs/sources.md, "Memory accounting". A study's trials
measure the real figure (device used − PyTorch's reserved, :mod:`launchers.measure.device_memory`), which then
replaces this default — a stated reserve always wins (:func:`optimizer.results.device_budget.with_measured_reserve`)."""
CUDA_ALLOCATOR_OVERHEAD = 0.12
"""``hardware.allocator_overhead`` of a CUDA study that does not state it: the caching allocator's reserved /
allocated − 1. Mist's published L4 runs measured 0.058–0.225 (mean 0.118, 26 configurations); 0.12 is that mean,
rounded (docs/sources.md, "Memory accounting")."""


def parse_hardware(section: Section) -> HardwareSpec:
    """The ``hardware`` section as a :class:`HardwareSpec` (module doc); UserError naming the key."""
    accelerator = section.get("accelerator", as_enum(Accelerator), Accelerator.CUDA)
    cuda = accelerator is Accelerator.CUDA
    profile = section.get("profile", lambda value: _profile(value, section), None)
    nvme_path = section.get("nvme_path", as_path, None)
    nvme_bytes = section.get("nvme_capacity", bytes_within(limits.MAX_NVME_BYTES, "NVMe capacity"), None)
    if nvme_path is not None and nvme_bytes is None:
        # The capacity is read from the path itself: the path must then exist here.
        if not Path(nvme_path).is_dir():
            raise section.error("nvme_path", f"{nvme_path!r} is not an existing directory "
                                "(give hardware.nvme_capacity to plan for another machine)")
        nvme_bytes = shutil.disk_usage(nvme_path).free
    gpu_memory = section.get("gpu_memory", DEVICE_BYTES)
    binary = size_family(section.raw.get("gpu_memory")) is True
    if profile is not None and profile.memory_bytes is not None and gpu_memory > profile.memory_bytes:
        raise section.error("gpu_memory", f"{format_bytes(gpu_memory, binary=binary)} is more than the "
                            f"{profile.name} device has ({format_bytes(profile.memory_bytes, binary=binary)}, "
                            "hardware.profile); a smaller figure is a budget, and fine")
    precisions = section.get("supported_precisions", _precision_list, None)
    if precisions is None:
        precisions = profile.precisions if profile is not None else (
            (Precision.FP32, Precision.BF16) if not cuda else tuple(Precision))
    elif profile is not None and (lacking := [p.value for p in precisions if p not in profile.precisions]):
        has = ", ".join(p.value for p in profile.precisions)
        raise section.error("supported_precisions", f"{', '.join(lacking)} is not a precision of the {profile.name} "
                            f"profile (hardware.profile has {has}); drop it from hardware.supported_precisions or "
                            "choose another hardware.profile")
    reserve = section.get("device_reserve", DEVICE_BYTES, None)
    if reserve is None and cuda and gpu_memory <= CUDA_DEVICE_RESERVE_BYTES:
        raise section.error("device_reserve", "not stated, so the CUDA default 1 GiB (CUDA context + NCCL buffers) "
                            f"applies, and gpu_memory is {format_bytes(gpu_memory, binary=binary)}: state the "
                            "reserve of this device")
    overhead = section.get("allocator_overhead", as_fraction, None)
    try:
        hardware = HardwareSpec(
            accelerator=accelerator,
            nodes=section.get("nodes", count_within(limits.MAX_DEVICES, "node count"), 1),
            gpus_per_node=section.get("gpus_per_node", count_within(limits.MAX_DEVICES, "devices per node")),
            gpu_memory_bytes=gpu_memory,
            binary_units=binary,
            device_reserve_bytes=reserve if reserve is not None else (CUDA_DEVICE_RESERVE_BYTES if cuda else 0),
            device_reserve_stated=reserve is not None,
            allocator_overhead=overhead if overhead is not None else (CUDA_ALLOCATOR_OVERHEAD if cuda else 0.0),
            allocator_overhead_stated=overhead is not None,
            host_memory_bytes=section.get("host_memory", HOST_BYTES, None),
            nvme_path=nvme_path,
            nvme_bytes=nvme_bytes,
            supported_precisions=precisions,
            profile=profile,
            inter_node_bytes_per_s=section.get("inter_node_bandwidth", parse_rate, None),
            nvme_bytes_per_s=section.get("nvme_bandwidth", parse_rate, None),
        )
    except ValueError as err:
        raise spec_error(section, err) from None
    section.finish()
    return hardware


def _precision_list(value: Any) -> tuple[Precision, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("expected a non-empty list such as [fp32, bf16]")
    return tuple(as_enum(Precision)(item) for item in value)


PROFILE_KEYS = ("base", "name", "flops", "precisions", "memory", "memory_bandwidth", "link_bandwidth",
                "host_bandwidth", "inter_node_bandwidth", "host_adam_params_per_s", "efficiency")
"""The keys of ``hardware.profile`` given as a mapping (docs/study-file.md, "Hardware keys")."""


def _profile(value: Any, hardware: Section) -> HardwareProfile:
    """A profile name, or a mapping of the figures (optionally ``base: NAME`` and overrides)."""
    if isinstance(value, str):
        return profile_named(value)
    if not isinstance(value, Mapping):
        raise ValueError("expected a profile name (such as a100-80gb) or a mapping of the device's figures "
                         "(flops, memory_bandwidth, link_bandwidth, host_bandwidth, ...)")
    section = Section(value, source=hardware.source, key=hardware.full_key("profile"))
    base = section.get("base", lambda v: profile_named(as_text(v)), None)
    flops_raw = section.get("flops", lambda v: v, None)
    flops: dict[Precision, float | None] = dict(base.peak_flops) if base is not None else {}
    given: list[Precision] = []
    if flops_raw is not None:
        table = Section(flops_raw, source=section.source, key=section.full_key("flops"))
        for precision in Precision:
            rate = table.get(precision.value, parse_flop_rate, None)
            if rate is not None:
                flops[precision] = rate
                given.append(precision)
        table.finish()
    precisions = section.get("precisions", _precision_list, None)
    if precisions is not None:
        if outside := [p for p in given if p not in precisions]:
            raise section.error(f"flops.{outside[0].value}", f"{outside[0].value} is not in "
                                f"{section.full_key('precisions')} ({', '.join(p.value for p in precisions)})")
    elif base is not None:
        precisions = tuple(p for p in Precision if p in base.precisions or p in given)
    elif given:
        precisions = tuple(p for p in Precision if p in given)
    else:
        raise section.error("flops", "a profile of the study's own figures needs flops per precision (such as "
                            "{bf16: 312 TFLOP/s, fp32: 19.5 TFLOP/s}) or precisions, or base: a built-in profile")
    default_name = "custom" if base is None else f"{base.name} (custom)"
    try:
        profile = HardwareProfile(
            name=section.get("name", as_text, default_name),
            peak_flops=tuple((p, flops.get(p)) for p in Precision if p in precisions),
            precisions=precisions,
            memory_bytes=section.get("memory", DEVICE_BYTES, base.memory_bytes if base else None),
            memory_bytes_per_s=section.get("memory_bandwidth", parse_rate, base.memory_bytes_per_s if base else None),
            link_bytes_per_s=section.get("link_bandwidth", parse_rate, base.link_bytes_per_s if base else None),
            pcie_bytes_per_s=section.get("host_bandwidth", parse_rate, base.pcie_bytes_per_s if base else None),
            inter_node_bytes_per_s=section.get("inter_node_bandwidth", parse_rate,
                                          base.inter_node_bytes_per_s if base else None),
            host_adam_params_per_s=section.get("host_adam_params_per_s", _positive,
                                          base.host_adam_params_per_s if base else None),
            efficiency=section.get("efficiency", as_fraction, base.efficiency if base else 0.4),
            device_pattern=base.device_pattern if base else None,
            sources=(("the study's own figures (hardware.profile)",) + (base.sources if base else ())),
        )
    except ValueError as err:  # efficiency out of (0, 1]: the only check the profile itself makes here
        raise section.error("efficiency", str(err)) from None
    section.finish()
    return profile


def _positive(value: Any) -> float:
    number = as_fraction(value)
    if number <= 0:
        raise ValueError(f"expected a number above 0, got {value!r}")
    return number
