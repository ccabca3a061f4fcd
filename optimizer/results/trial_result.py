"""Typed trial results and the pure arithmetic on them: outcome, aggregation over ranks, loss fidelity.

A trial's four results are the seed's: per-card peak memory (allocated and reserved), step time and
throughput, loss and gradient sanity, and agreement with an FP32 baseline (loss fidelity). A failing
trial is data: it carries its :class:`Outcome` and the tail of its log. A trial given a :class:`StopAbove`
stops as soon as a rank's measured peak goes over it (``launchers/rank/trial_rank.py``); it is an ``oom``
that keeps what it measured until then, and where it stopped (``stopped_at``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from optimizer.results.host_oom import HostMemoryEvidence, host_oom_reason
from optimizer.results.loss_scaling import reference_indices


class Outcome(StrEnum):
    """How a trial ended."""

    OK = "ok"
    OOM = "oom"
    OOM_HOST = "oom_host"  # host memory: a failed host allocation on CUDA ranks, or the kernel's OOM killer
    NAN = "nan"
    UNSUPPORTED = "unsupported"
    TIMEOUT = "timeout"
    CRASH = "crash"
    INVALID = "invalid"


# When ranks disagree, the most specific failure wins: an OOM on one rank is the cause of the
# others being torn down (they then report nothing, or a crash). A rank stopped over the budget
# (OVER_BUDGET) ranks below all of these, and below a host OOM, a timeout and a lost rank: every rank
# stops there together and cleanly, so any other failure beside it is news of its own.
_PRIORITY = (Outcome.OOM, Outcome.OOM_HOST, Outcome.UNSUPPORTED, Outcome.NAN, Outcome.CRASH)
OVER_BUDGET = "over_budget"
"""The status of a rank's report when the trial stopped over its :class:`StopAbove` (an ``oom`` trial)."""
INIT_STOP = "init"
"""``stopped_at`` of a trial stopped over the init phase's limit; ``"step N"`` after attempted step N (0-based)."""
DEVICE_MEMORY_FIELDS = ("device_memory_source", "device_used_init_bytes", "device_non_torch_init_bytes",
                        "device_used_peak_bytes", "device_non_torch_peak_bytes")
"""The rank report's readings of the device as the driver sees it (:mod:`launchers.measure.device_memory`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StopAbove:
    """The per-rank measured peak above which a rank stops — CUDA: ``max_memory_reserved``; CPU ranks: the
    live-tensor peak (:mod:`launchers.measure.cpu_memory`). A peak equal to a limit goes on."""

    training_bytes: int
    """The training phase's limit: the peak after the init phase (bytes)."""
    init_bytes: int
    """The init phase's limit: model construction + ``deepspeed.initialize`` (bytes)."""

    def __post_init__(self) -> None:
        for name in ("training_bytes", "init_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"StopAbove.{name} must be a non-negative integer number of bytes, got {value!r}")

    def to_plan(self) -> dict[str, int]:
        """As the rank plan carries it (``plan["stop_above"]``)."""
        return {"training_bytes": self.training_bytes, "init_bytes": self.init_bytes}

    @classmethod
    def from_plan(cls, data: Mapping[str, Any]) -> StopAbove:
        """Back from :meth:`to_plan`'s dict."""
        return cls(training_bytes=data["training_bytes"], init_bytes=data["init_bytes"])


def stop_order(stopped_at: str) -> int:
    """Where ``stopped_at`` falls in a run: the init phase (-1) before attempted step N (N)."""
    return -1 if stopped_at == INIT_STOP else int(stopped_at.removeprefix("step "))


@dataclass(frozen=True, kw_only=True, slots=True)
class RankMeasurement:
    """What one rank measured."""

    rank: int
    """Global rank."""
    peak_allocated_bytes: int | None
    """CUDA ``max_memory_allocated``; CPU ranks: the live-tensor peak from the profiler."""
    peak_reserved_bytes: int | None
    """CUDA ``max_memory_reserved``; None on CPU ranks (no caching allocator)."""
    peak_rss_bytes: int
    """The process's peak resident set size."""
    step_times_s: tuple[float, ...]
    """Wall time of each measured optimizer step (the step's batches are built before its clock starts)."""
    init_s: float | None = None
    """Wall time of the init phase: model construction + ``deepspeed.initialize`` (s)."""
    gc_pause_s: float | None = None
    """Seconds in CPython's cyclic collections from the first measured step on, once the warm-up's heap was settled
    (:mod:`launchers.measure.gc_pauses`); None where the report has none (written before, or no measured step)."""
    gc_full_collections: int | None = None
    """How many of those collections were full (generation 2): ~0.2 s each in a process that imported transformers."""
    init_peak_allocated_bytes: int | None = None
    """The allocated (CPU ranks: live-tensor) peak of the init phase alone."""
    build_peak_allocated_bytes: int | None = None
    """The allocated (CPU ranks: live-tensor) peak while the model was built, before ``deepspeed.initialize``."""
    init_peak_reserved_bytes: int | None = None
    """The CUDA reserved peak of the init phase alone; None on CPU ranks."""
    construction: str | None = None
    """How the model was built: ``zero_init``, ``device`` or ``full`` (:mod:`launchers.models.construction`)."""
    built_partitioned: bool | None = None
    """Whether the parameters were ZeRO-3 partitioned as they were built (``zero.Init`` took effect)."""
    training_peak_allocated_bytes: int | None = None
    """The allocated (CPU ranks: live-tensor) peak of training alone, after the init phase."""
    training_peak_reserved_bytes: int | None = None
    """The CUDA reserved peak of training alone (the pool init left cached included); None on CPU ranks."""
    device_memory_source: str | None = None
    """Which reader gave the ``device_*`` figures: ``nvml_process``, ``nvml_device`` or ``cuda_mem_get_info``
    (:mod:`launchers.measure.device_memory`); None on CPU ranks, or where no reader answered."""
    device_used_init_bytes: int | None = None
    """The process's use of its device as the driver sees it (CUDA context, NCCL, cuBLAS and PyTorch's pool), read
    once ``deepspeed.initialize`` is done (bytes; None on CPU ranks)."""
    device_non_torch_init_bytes: int | None = None
    """At that reading, the use outside PyTorch's pool: used − ``torch.cuda.memory_reserved()`` (bytes)."""
    device_used_peak_bytes: int | None = None
    """The largest training reading of the device use (after each attempted step, and at the end): sampled, so a
    lower bound of the device's true peak — the driver keeps no peak (bytes; None: no step run, or CPU ranks)."""
    device_non_torch_peak_bytes: int | None = None
    """At that reading, the use outside PyTorch's pool: used − ``torch.cuda.memory_reserved()`` (bytes)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialResult:
    """One candidate, run for real: the outcome and, when ok, the measurements."""

    outcome: Outcome
    """How it ended."""
    ranks: tuple[RankMeasurement, ...] = ()
    """Per-rank measurements (ok trials)."""
    losses: tuple[float, ...] = ()
    """Loss of every optimizer step (warm-up included), mean over ranks and micro-batches."""
    grad_norms: tuple[float | None, ...] = ()
    """Global gradient norm after every step (None where DeepSpeed reports none)."""
    applied: tuple[bool, ...] = ()
    """Per attempted step: whether its update was applied (False: an fp16 overflow, skipped and replayed);
    empty when every step was applied (results recorded before this was measured)."""
    loss_scales: tuple[float | None, ...] = ()
    """The fp16 loss scale after each attempted step (None outside fp16)."""
    step_time_s: float | None = None
    """Median over measured steps of the slowest rank's step time (s)."""
    tokens_per_s: float | None = None
    """Global batch × sequence length / step time."""
    loss_fidelity: float | None = None
    """Largest relative deviation of the per-step losses from the FP32 reference (None: no reference)."""
    message: str = ""
    """For failures: what went wrong (exception type and text, or the launcher's reason)."""
    log_tail: str = ""
    """For failures: the end of the combined log."""
    wall_s: float = 0.0
    """Wall time of the whole launch (s)."""
    stopped_at: str | None = None
    """None for a run that went to the end; ``"init"`` or ``"step N"`` (N: the 0-based index of the attempted
    step after which it stopped) for a run stopped over its :class:`StopAbove` (outcome ``oom``)."""
    device_name: str | None = None
    """``torch.cuda.get_device_name()`` of the devices the ranks ran on (None: CPU ranks, or no rank reported)."""
    device_total_bytes: int | None = None
    """``torch.cuda.get_device_properties(dev).total_memory`` of those devices (bytes; None as above)."""
    script_parameters: int | None = None
    """A script trial (``trial.command``): the parameters of the model the script's engine trains (ZeRO-3's full
    counts), beside the model section's planned count; None for dsopt's own step."""
    script_trainable_parameters: int | None = None
    """A script trial: how many of them train (``requires_grad``: PEFT's adapters, what the script left unfrozen),
    beside the planned Ψtr (``model.peft``, ``training.frozen``); None for dsopt's own step."""
    draws_random: bool = False
    """A rank saw its training draw random numbers (dropout masks; ``launchers/measure/rng_draws.py``): an FP32
    reference that drew makes each micro-batch be judged by its own (``launchers/trial/reference_batches.py``)."""
    reference_launches: int = 0
    """FP32 reference runs launched to judge this trial besides its own launch: the reference at its micro-batch size
    where training draws dropout masks (``launchers/trial/reference_batches.py``), 1 the first time it is needed.
    ``--n-trials`` and ``budget.max_launches`` count them with the trial's (:mod:`optimizer.search.objective`)."""

    def _rank_max(self, field: str) -> int | float | None:
        values = [v for r in self.ranks if (v := getattr(r, field)) is not None]
        return max(values) if values else None

    @property
    def peak_memory_bytes(self) -> int | None:
        """Max over ranks of the peak allocated (CPU: live-tensor) bytes."""
        return self._rank_max("peak_allocated_bytes")  # type: ignore[return-value]

    @property
    def peak_reserved_bytes(self) -> int | None:
        """Max over ranks of the CUDA reserved peak (None on CPU ranks)."""
        return self._rank_max("peak_reserved_bytes")  # type: ignore[return-value]

    @property
    def init_peak_memory_bytes(self) -> int | None:
        """Max over ranks of the init phase's allocated (CPU: live-tensor) peak."""
        return self._rank_max("init_peak_allocated_bytes")  # type: ignore[return-value]

    @property
    def training_peak_memory_bytes(self) -> int | None:
        """Max over ranks of training's allocated (CPU: live-tensor) peak; the whole run's when not measured apart."""
        value = self._rank_max("training_peak_allocated_bytes")
        return self.peak_memory_bytes if value is None else value  # type: ignore[return-value]

    @property
    def training_peak_reserved_bytes(self) -> int | None:
        """Max over ranks of training's CUDA reserved peak (None on CPU ranks)."""
        return self._rank_max("training_peak_reserved_bytes")  # type: ignore[return-value]

    @property
    def init_peak_reserved_bytes(self) -> int | None:
        """Max over ranks of the init phase's CUDA reserved peak (None on CPU ranks)."""
        return self._rank_max("init_peak_reserved_bytes")  # type: ignore[return-value]

    @property
    def device_used_init_bytes(self) -> int | None:
        """Max over ranks of the device use read after ``deepspeed.initialize`` (None on CPU ranks)."""
        return self._rank_max("device_used_init_bytes")  # type: ignore[return-value]

    @property
    def device_used_peak_bytes(self) -> int | None:
        """Max over ranks of the largest training reading of the device use (sampled; None on CPU ranks)."""
        return self._rank_max("device_used_peak_bytes")  # type: ignore[return-value]

    @property
    def device_non_torch_init_bytes(self) -> int | None:
        """Max over ranks of the device use outside PyTorch's pool after ``deepspeed.initialize``."""
        return self._rank_max("device_non_torch_init_bytes")  # type: ignore[return-value]

    @property
    def device_non_torch_peak_bytes(self) -> int | None:
        """Max over ranks of the device use outside PyTorch's pool at the largest training reading."""
        return self._rank_max("device_non_torch_peak_bytes")  # type: ignore[return-value]

    @property
    def device_memory_source(self) -> str | None:
        """The reader of the ``device_*`` figures (the first rank's that has one; None: CPU ranks)."""
        return next((r.device_memory_source for r in self.ranks if r.device_memory_source), None)

    def training_device_bytes(self, *, device_reserve_bytes: int) -> int | None:
        """What training needs of one device: its reserved peak (CPU ranks: live tensors) + the device reserve
        (CUDA context, NCCL) — the memory that runs out, the study's memory objective."""
        peak = self.training_peak_reserved_bytes or self.training_peak_memory_bytes
        return None if peak is None else peak + device_reserve_bytes

    def init_device_bytes(self, *, device_reserve_bytes: int) -> int | None:
        """What the init phase needs of one device: its reserved (CPU: live-tensor) peak + the device reserve."""
        peak = self.init_peak_reserved_bytes or self.init_peak_memory_bytes
        return None if peak is None else peak + device_reserve_bytes

    @property
    def skipped_steps(self) -> int:
        """Attempted steps whose update was skipped (fp16 overflows)."""
        return sum(1 for was_applied in self.applied if not was_applied)

    @property
    def init_s(self) -> float | None:
        """The slowest rank's init time (model construction + ``deepspeed.initialize``), s."""
        return self._rank_max("init_s")

    @property
    def step_time_range_s(self) -> tuple[float, float] | None:
        """The fastest and the slowest measured step (each step: its slowest rank) — the spread that
        :attr:`step_time_s`, their median, hides (None: no measured step)."""
        per_step = [max(times) for times in zip(*(r.step_times_s for r in self.ranks), strict=True)]
        return (min(per_step), max(per_step)) if per_step else None

    @property
    def gc_pause_s(self) -> float | None:
        """The most seconds a rank spent in cyclic collections in its measured steps (None: not recorded)."""
        return self._rank_max("gc_pause_s")

    @property
    def gc_full_collections(self) -> int | None:
        """The most full (generation-2) collections a rank ran in its measured steps (None: not recorded)."""
        return self._rank_max("gc_full_collections")  # type: ignore[return-value]

    @property
    def peak_rss_bytes(self) -> int | None:
        """Max over ranks of the process peak RSS."""
        return self._rank_max("peak_rss_bytes")  # type: ignore[return-value]


def loss_fidelity(losses: Sequence[float], reference: Sequence[float], applied: Sequence[bool] = ()) -> float:
    """max_i |loss_i − ref_j| / |ref_j| where j is the number of updates applied before attempt i (i itself
    when every step was applied): the same batch after the same number of updates, by construction
    (:func:`optimizer.results.loss_scaling.reference_indices`)."""
    indices = reference_indices(applied) if applied else list(range(len(losses)))
    if applied and len(applied) != len(losses):
        raise ValueError(f"{len(applied)} applied flags for {len(losses)} losses")
    if not losses or (not applied and len(losses) != len(reference)) or max(indices) >= len(reference):
        raise ValueError(f"cannot compare {len(losses)} losses with {len(reference)} reference losses")
    return max(abs(a - reference[j]) / abs(reference[j]) if reference[j] else abs(a - reference[j])
               for a, j in zip(losses, indices, strict=True))


def summarize(
    *,
    rank_reports: Mapping[int, Mapping[str, Any]],
    world_size: int,
    returncode: int | None,
    timed_out: bool,
    tokens_per_step: int,
    reference_losses: Sequence[float] | None,
    log_tail: str,
    wall_s: float,
    host_memory: HostMemoryEvidence | None = None,
) -> TrialResult:
    """Turn the ranks' reports and the launcher's exit into one :class:`TrialResult`.

    ``rank_reports`` maps rank → the JSON each rank wrote (missing ranks wrote nothing, e.g. killed);
    ``host_memory``: what the launcher saw of host memory — ranks the kernel's OOM killer ended are
    ``oom_host``, not ``crash`` (:func:`optimizer.results.host_oom.host_oom_reason`), as are the peers that crashed
    when they went. Ranks that stopped over their :class:`StopAbove` (status :data:`OVER_BUDGET`, all of them
    together) make an ``oom`` with what they measured until then — per-rank peaks as far as known, the losses
    and the measured steps' times so far (step time None when none was measured), no loss fidelity — and the
    earliest ``stopped_at``; any other failure beside them wins (see ``_PRIORITY``).
    """
    device = _device(rank_reports)
    statuses = {report.get("status") for report in rank_reports.values()}
    failures = [o for o in _PRIORITY if o.value in statuses]
    missing = sorted(set(range(world_size)) - set(rank_reports))
    host_oom = host_oom_reason(returncode=returncode, missing_ranks=missing, evidence=host_memory)
    if failures and not (failures[0] is Outcome.CRASH and host_oom):
        worst = failures[0]
        report = next(r for r in rank_reports.values() if r.get("status") == worst.value)
        return TrialResult(outcome=worst, message=f"rank {report.get('rank')}: {report.get('error_type')}: "
                           f"{report.get('message', '')}", log_tail=log_tail, wall_s=wall_s, **device)
    if host_oom:
        return TrialResult(outcome=Outcome.OOM_HOST, message=host_oom, log_tail=log_tail, wall_s=wall_s, **device)
    if timed_out:
        return TrialResult(outcome=Outcome.TIMEOUT, message="the launch ran past its timeout and was killed",
                           log_tail=log_tail, wall_s=wall_s, **device)
    if returncode != 0 or len(rank_reports) != world_size or not statuses <= {Outcome.OK.value, OVER_BUDGET}:
        return TrialResult(outcome=Outcome.CRASH, log_tail=log_tail, wall_s=wall_s, **device,
                           message=f"launcher exit code {returncode}; ranks without a report: {missing}")
    ranks = _measurements(rank_reports)
    losses = tuple(rank_reports[0]["losses"])
    applied = tuple(bool(a) for a in rank_reports[0].get("applied", ()))
    if all(applied):
        applied = ()  # every step applied: nothing to say
    per_step = [max(times) for times in zip(*(r.step_times_s for r in ranks), strict=True)]
    step_time = statistics.median(per_step) if per_step else None
    so_far = {"ranks": ranks, "losses": losses, "grad_norms": tuple(rank_reports[0]["grad_norms"]),
              "applied": applied, "loss_scales": tuple(rank_reports[0].get("loss_scales", ())),
              "step_time_s": step_time, "tokens_per_s": (tokens_per_step / step_time) if step_time else None,
              "wall_s": wall_s, "draws_random": any(bool(r.get("draws_random")) for r in rank_reports.values()),
              **device}
    if OVER_BUDGET in statuses:  # stopped over the budget: what was measured, no fidelity
        stopped_at, message = _stop_reason(rank_reports)
        return TrialResult(outcome=Outcome.OOM, stopped_at=stopped_at, message=message, log_tail=log_tail,
                           **so_far)
    fidelity = None if reference_losses is None else loss_fidelity(losses, reference_losses, applied)
    if not all(math.isfinite(x) for x in losses):  # the ranks raise first; kept as a guard
        return TrialResult(outcome=Outcome.NAN, losses=losses, message="non-finite loss", wall_s=wall_s, **device)
    return TrialResult(outcome=Outcome.OK, loss_fidelity=fidelity, **so_far)


def wrong_device(rank_reports: Mapping[int, Mapping[str, Any]], *, expected: str) -> str | None:
    """Why the ranks' results are not the study's (``expected``: ``cuda`` or ``cpu``): the first rank that reports
    having run on another device, as a trial error's message; None when every report that names a device names
    ``expected`` (a rank that failed before it knew names none)."""
    for rank, report in sorted(rank_reports.items()):
        used = report.get("device")
        if used is not None and used != expected:
            return (f"rank {rank} ran on {used}, but the study's hardware.accelerator is {expected}: its figures "
                    f"are not this study's (is DS_ACCELERATOR or CUDA_VISIBLE_DEVICES set for another device?)")
    return None


def _device(rank_reports: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The device the ranks ran on, from the first report that names one (reports written before the name was
    recorded, and CPU ranks, name none): ``device_name`` and ``device_total_bytes`` for :class:`TrialResult`."""
    named = next((rep for _, rep in sorted(rank_reports.items()) if rep.get("device_name")), {})
    return {"device_name": named.get("device_name"), "device_total_bytes": named.get("device_total_bytes")}


def _gc_pauses(report: Any) -> dict[str, Any]:
    """A rank report's ``gc_pauses`` (``{"collections": [g0, g1, g2], "seconds": s}``) as :class:`RankMeasurement`'s
    fields; None for a report without it (written before, or no measured step)."""
    if not isinstance(report, Mapping):
        return {"gc_pause_s": None, "gc_full_collections": None}
    counts = report.get("collections")
    full = counts[2] if isinstance(counts, list) and len(counts) == 3 else None
    return {"gc_pause_s": report.get("seconds"), "gc_full_collections": full}


def _measurements(rank_reports: Mapping[int, Mapping[str, Any]]) -> tuple[RankMeasurement, ...]:
    """Each rank's measurements from its report (ok, or stopped over the budget: what it measured until then)."""
    return tuple(
        RankMeasurement(rank=r, peak_allocated_bytes=rep["peak_allocated_bytes"],
                        peak_reserved_bytes=rep["peak_reserved_bytes"], peak_rss_bytes=rep["peak_rss_bytes"],
                        step_times_s=tuple(rep["step_times_s"]), init_s=rep.get("init_s"),
                        **_gc_pauses(rep.get("gc_pauses")),
                        init_peak_allocated_bytes=rep.get("init_peak_allocated_bytes"),
                        init_peak_reserved_bytes=rep.get("init_peak_reserved_bytes"),
                        build_peak_allocated_bytes=rep.get("build_peak_allocated_bytes"),
                        construction=rep.get("construction"), built_partitioned=rep.get("built_partitioned"),
                        training_peak_allocated_bytes=rep.get("training_peak_allocated_bytes"),
                        training_peak_reserved_bytes=rep.get("training_peak_reserved_bytes"),
                        **{name: rep.get(name) for name in DEVICE_MEMORY_FIELDS})
        for r, rep in sorted(rank_reports.items())
    )


def _stop_reason(rank_reports: Mapping[int, Mapping[str, Any]]) -> tuple[str, str]:
    """(the earliest ``stopped_at`` of the stopped ranks, why): the first rank whose own peak went over the
    limit of the phase it stopped in (``over_limit`` in its report; its peers stopped with it)."""
    stopped = [rep for _, rep in sorted(rank_reports.items()) if rep.get("status") == OVER_BUDGET]
    stopped_at = min((rep["stopped_at"] for rep in stopped), key=stop_order)
    phase = "init" if stopped_at == INIT_STOP else "training"
    over = [rep for rep in stopped if (rep.get("over_limit") or {}).get("phase") == phase] \
        or [rep for rep in stopped if rep.get("over_limit")]
    if not over:
        return stopped_at, f"stopped at {stopped_at}: no rank says which peak went over its limit"
    rep = over[0]
    limit = rep["over_limit"]
    return stopped_at, (f"stopped at {stopped_at}: measured {limit['phase']} peak {limit['peak_bytes']} bytes above "
                        f"the limit {limit['limit_bytes']} bytes (rank {rep['rank']})")
