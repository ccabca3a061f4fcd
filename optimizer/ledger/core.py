"""The analytic memory ledger: every byte per GPU, per host and on NVMe, and the verdict (pure).

A ledger is a list of :class:`LedgerItem` — one tensor class each, with its bytes *per rank*,
where it lives (GPU, host, NVMe), which category it belongs to, when it is live, and the formula
and source it came from. From the items:

* the per-GPU peak is the always-live items plus the larger of the backward-phase and the
  step-phase items (activations are gone by the optimizer step; the step's FP32 gradient copy
  does not exist during backward) — the seed's rule, "measure the per-card *peak*";
* the per-host and NVMe totals add up every rank on one node;
* the verdict compares the GPU peak, inflated by the allocator's reserved/allocated overhead and
  the device reserve (CUDA context, NCCL), with the device memory; host and NVMe totals with
  their capacities.

Two modes fill the items: seed mode (:mod:`optimizer.ledger.seed`, the seed's explicit numbers)
and transformer mode (:mod:`optimizer.ledger.model_states`, :mod:`optimizer.ledger.transformer`,
:mod:`optimizer.ledger.init_phase`, following what DeepSpeed allocates). Nothing here imports torch
or deepspeed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from optimizer.ledger.items import TRANSIENT_PHASES, Category, LedgerItem, Location, Phase
from optimizer.ledger.model_states import transformer_items
from optimizer.ledger.seed import seed_items
from optimizer.study.constraints import invalid_reasons
from optimizer.study.knobs import Candidate
from optimizer.study.specs import Accelerator, HardwareSpec, ModelSpec, SeedModel, TrainingSpec
from optimizer.study.units import format_size

__all__ = [
    "Category",
    "InvalidCandidate",
    "Ledger",
    "LedgerItem",
    "Location",
    "Phase",
    "Verdict",
    "compute_ledger",
    "evaluate",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Ledger:
    """The itemised memory of one candidate and the verdict."""

    candidate: Candidate
    """The candidate this ledger is for."""
    items: tuple[LedgerItem, ...]
    """Every item, bytes per rank."""
    ranks_per_node: int
    """Ranks sharing one host and one NVMe."""
    device_is_host: bool
    """CPU ranks: the "device" memory is host RAM, so the host check includes it."""
    gpu_capacity_bytes: int
    """Nominal device memory."""
    device_reserve_bytes: int
    """Outside the allocator: CUDA context, NCCL buffers."""
    allocator_overhead: float
    """Reserved/allocated − 1 assumed for the caching allocator."""
    host_capacity_bytes: int | None
    """Host RAM per node; None = unchecked."""
    nvme_capacity_bytes: int | None
    """NVMe capacity per node; None = unchecked."""
    risks: tuple[LedgerItem, ...] = ()
    """Items live in some runs only (:attr:`LedgerItem.sometimes`): in no figure of this ledger but
    :attr:`risk_bytes` — what the candidate needs is what every run holds."""

    def _at(self, location: Location | tuple[Location, ...], phase: Phase, *, risks: bool = False) -> list[LedgerItem]:
        where = location if isinstance(location, tuple) else (location,)
        return [i for i in self.items + (self.risks if risks else ()) if i.location in where and i.phase is phase]

    def _phase_bytes(self, location: Location | tuple[Location, ...], phase: Phase, *, risks: bool = False) -> int:
        return sum(i.bytes for i in self._at(location, phase, risks=risks))

    def _largest_transient(self, location: Location | tuple[Location, ...]) -> Phase:
        """The training phase whose transient items at ``location`` weigh most (the earlier one on a tie)."""
        return max(TRANSIENT_PHASES, key=lambda ph: (self._phase_bytes(location, ph), -TRANSIENT_PHASES.index(ph)))

    def peak_phase_at(self, location: Location | tuple[Location, ...]) -> Phase:
        """The phase of the peak at ``location`` (or at several locations that share one memory)."""
        always = self._phase_bytes(location, Phase.ALWAYS)
        best = self._largest_transient(location)
        if self._phase_bytes(location, Phase.INIT) > always + self._phase_bytes(location, best):
            return Phase.INIT
        return best

    def peak_items_at(self, location: Location | tuple[Location, ...]) -> list[LedgerItem]:
        """Items live at the peak of ``location``."""
        phase = self.peak_phase_at(location)
        if phase is Phase.INIT:
            return self._at(location, Phase.INIT)
        return self._at(location, Phase.ALWAYS) + self._at(location, phase)

    def peak_bytes_at(self, location: Location | tuple[Location, ...]) -> int:
        """Bytes one rank holds at the peak of ``location``."""
        return sum(i.bytes for i in self.peak_items_at(location))

    @property
    def host_locations(self) -> tuple[Location, ...]:
        """What lives in host RAM: host items, and on CPU ranks the device items too (one memory, one peak)."""
        return (Location.HOST, Location.GPU) if self.device_is_host else (Location.HOST,)

    @property
    def peak_phase(self) -> Phase:
        """The phase of the per-GPU peak."""
        return self.peak_phase_at(Location.GPU)

    def peak_items(self) -> list[LedgerItem]:
        """GPU items live at the per-GPU peak."""
        return self.peak_items_at(Location.GPU)

    def per_gpu(self) -> dict[str, int]:
        """Bytes per GPU at the peak, by category, plus ``total``."""
        out = {category.value: 0 for category in Category}
        for item in self.peak_items():
            out[item.category.value] += item.bytes
        out["total"] = sum(out.values())
        return out

    def phase_totals(self) -> dict[str, int]:
        """Per-GPU bytes if each phase were the peak."""
        always = self._phase_bytes(Location.GPU, Phase.ALWAYS)
        out = {ph.value: always + self._phase_bytes(Location.GPU, ph) for ph in TRANSIENT_PHASES}
        out[Phase.INIT.value] = self._phase_bytes(Location.GPU, Phase.INIT)
        return out

    @property
    def init_bytes(self) -> int:
        """Bytes one rank's device holds at the peak of the init phase (CPU ranks: device and host items)."""
        where = self.host_locations if self.device_is_host else (Location.GPU,)
        return self._phase_bytes(where, Phase.INIT)

    def training_bytes_at(self, location: Location | tuple[Location, ...], *, risks: bool = False) -> int:
        """Bytes one rank holds at ``location`` at training's peak: the always-live items and the largest
        transient phase, the init phase left out; with ``risks``, in a run where every :attr:`risks` item is live."""
        return self._phase_bytes(location, Phase.ALWAYS, risks=risks) + max(
            self._phase_bytes(location, ph, risks=risks) for ph in TRANSIENT_PHASES)

    @property
    def risk_bytes(self) -> int:
        """How far training's measured peak (:attr:`training_bytes`) may exceed the ledger in a run where the
        :attr:`risks` items are live: 0 without risks, at most their sum (they may fall outside the peak's
        phase). The launch margin covers it (:meth:`optimizer.search.ordering.StudyModels.margin_bytes`)."""
        if not self.risks:  # every GPU ledger, most CPU ones: assess() asks this for every candidate
            return 0
        where = self.host_locations if self.device_is_host else (Location.GPU,)
        return self.training_bytes_at(where, risks=True) - self.training_bytes_at(where)

    @property
    def training_bytes(self) -> int:
        """Bytes one rank's device holds at training's peak (CPU ranks: device and host items)."""
        return self.training_bytes_at(self.host_locations if self.device_is_host else (Location.GPU,))

    @property
    def training_host_share_bytes(self) -> int:
        """On CPU ranks, the host items' bytes at training's peak of the one memory device and host items share
        (the always-live ones and the peak phase's): what a measurement of that memory holds beyond the
        device's share. 0 on a GPU, whose device is measured apart."""
        if not self.device_is_host:
            return 0
        phase = self._largest_transient(self.host_locations)
        return self._phase_bytes(Location.HOST, Phase.ALWAYS) + self._phase_bytes(Location.HOST, phase)

    def init_bytes_at(self, location: Location | tuple[Location, ...]) -> int:
        """Bytes one rank holds at ``location`` at the init phase's peak."""
        return self._phase_bytes(location, Phase.INIT)

    @property
    def training_needed_bytes(self) -> int:
        """Device memory training alone needs: its allocated peak × (1 + overhead), rounded up, + device reserve
        (what a trial's training peak in reserved bytes + the reserve is compared with)."""
        return math.ceil(self.training_bytes_at(Location.GPU) * (1.0 + self.allocator_overhead)) \
            + self.device_reserve_bytes

    @property
    def estimated_bytes(self) -> int:
        """Of training's device peak, the bytes the ledger *estimates* rather than counts: activations (a trace
        or a formula) and the transient buffers (ZeRO-3's gathered parameters, buckets). Model states —
        parameters, gradients, optimizer states, master weights — are counted from the parameter inventory
        and DeepSpeed's own partitioning, checked byte for byte on real ranks (tests/real/deepspeed/
        test_model_states_real.py). The launch margin scales with this share (:mod:`optimizer.search.ordering`)."""
        transient = self._largest_transient(Location.GPU)
        live = self._at(Location.GPU, Phase.ALWAYS) + self._at(Location.GPU, transient)
        return sum(i.bytes for i in live if i.category is Category.ACTIVATIONS
                   or (i.category is Category.BUFFERS and i.phase is not Phase.ALWAYS))

    @property
    def init_needed_bytes(self) -> int:
        """Device memory the init phase needs: its allocated peak × (1 + overhead), rounded up, + device reserve."""
        return math.ceil(self.init_bytes_at(Location.GPU) * (1.0 + self.allocator_overhead)) \
            + self.device_reserve_bytes

    @property
    def predicted_reserved_bytes(self) -> int:
        """The allocator's reserved peak: allocated peak × (1 + overhead), rounded up."""
        return math.ceil(self.per_gpu()["total"] * (1.0 + self.allocator_overhead))

    @property
    def gpu_needed_bytes(self) -> int:
        """Device memory the candidate needs: reserved peak + device reserve."""
        return self.predicted_reserved_bytes + self.device_reserve_bytes

    @property
    def host_bytes(self) -> int:
        """Host RAM one node needs: every rank's host peak (CPU ranks: of host and device items together)."""
        return self.ranks_per_node * self.peak_bytes_at(self.host_locations)

    @property
    def nvme_bytes(self) -> int:
        """NVMe one node needs for the swapped state of all its ranks."""
        return self.ranks_per_node * self.peak_bytes_at(Location.NVME)

    @property
    def fits_gpu(self) -> bool:
        return self.gpu_needed_bytes <= self.gpu_capacity_bytes

    @property
    def fits_host(self) -> bool | None:
        """None when the study gives no host capacity."""
        return None if self.host_capacity_bytes is None else self.host_bytes <= self.host_capacity_bytes

    @property
    def fits_nvme(self) -> bool | None:
        """True when nothing goes to NVMe; None when the study gives no NVMe capacity."""
        if self.nvme_bytes == 0:
            return True
        return None if self.nvme_capacity_bytes is None else self.nvme_bytes <= self.nvme_capacity_bytes

    @property
    def fits(self) -> bool:
        """Fits when the GPU peak fits and host and NVMe are not known to overflow."""
        return self.fits_gpu and self.fits_host is not False and self.fits_nvme is not False

    def verdict_reasons(self) -> tuple[str, ...]:
        """Why it does not fit (empty when it fits), in decimal units (GB = 10^9 bytes)."""
        checks = (
            ("GPU", self.fits_gpu, self.gpu_needed_bytes, self.gpu_capacity_bytes),
            ("host", self.fits_host, self.host_bytes, self.host_capacity_bytes),
            ("NVMe", self.fits_nvme, self.nvme_bytes, self.nvme_capacity_bytes),
        )
        return tuple(f"{where} needs {format_size(needed)} of {format_size(capacity or 0)}"
                     for where, fits, needed, capacity in checks if fits is False)


class InvalidCandidate(ValueError):
    """The candidate is not a combination DeepSpeed (or the study) can run; ``reasons`` says why."""

    def __init__(self, reasons: tuple[str, ...]) -> None:
        self.reasons = reasons
        super().__init__("; ".join(reasons))


def compute_ledger(
    *, candidate: Candidate, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec
) -> Ledger:
    """The ledger of ``candidate``; raises :class:`InvalidCandidate` for an impossible combination."""
    reasons = invalid_reasons(candidate=candidate, model=model, hardware=hardware, training=training)
    if reasons:
        raise InvalidCandidate(reasons)
    if isinstance(model, SeedModel):
        items = seed_items(candidate=candidate, model=model, hardware=hardware, training=training)
    else:
        items = transformer_items(candidate=candidate, model=model, hardware=hardware, training=training)
    return Ledger(
        candidate=candidate,
        items=tuple(i for i in items if not i.sometimes),
        risks=tuple(i for i in items if i.sometimes),
        ranks_per_node=hardware.gpus_per_node,
        device_is_host=hardware.accelerator is Accelerator.CPU,
        gpu_capacity_bytes=hardware.gpu_memory_bytes,
        device_reserve_bytes=hardware.device_reserve_bytes,
        allocator_overhead=hardware.allocator_overhead,
        host_capacity_bytes=hardware.host_memory_bytes,
        nvme_capacity_bytes=hardware.nvme_bytes,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """A candidate and its ledger, or the reasons it is invalid (then ``ledger`` is None)."""

    candidate: Candidate
    """The candidate."""
    ledger: Ledger | None
    """Its ledger when valid."""
    invalid_reasons: tuple[str, ...] = ()
    """Why DeepSpeed (or the study) cannot run it."""

    @property
    def fits(self) -> bool:
        """Valid and predicted to fit: the pruning rule's "launch" answer."""
        return self.ledger is not None and self.ledger.fits


def evaluate(
    *, candidate: Candidate, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec
) -> Verdict:
    """The ledger of ``candidate`` or, for an impossible combination, the reasons — never an exception."""
    try:
        ledger = compute_ledger(candidate=candidate, model=model, hardware=hardware, training=training)
    except InvalidCandidate as invalid:
        return Verdict(candidate=candidate, ledger=None, invalid_reasons=invalid.reasons)
    return Verdict(candidate=candidate, ledger=ledger)
