"""The study file's cluster sections: the study's global budget, worker heartbeats, and SLURM submission.

::

    budget:                       # enforced across all workers of the study
      max_launches: 40            # real DeepSpeed launches, retries and the FP32 reference included
      deadline: 2026-11-30T07:00:00+00:00   # no launch starts after this instant
      max_hours: 10               # or: no launch starts this long after the study was created
      headroom: 5 %               # of hardware.gpu_memory, kept free by the exported pick (or 0.05; default below)
    workers:
      heartbeat_s: 60             # Optuna RDBStorage heartbeat interval (PostgreSQL)
      grace_s: 180                # a trial with no heartbeat this long is failed (stale) ...
      max_retry: 2                # ... and retried by another worker at most this many times
    slurm:
      partition: gpu
      account: my-project
      time: "12:00:00"
      cpus_per_task: 32
      mem: 0
      sbatch: ["--qos=normal"]    # any other sbatch option, verbatim
      setup: ["module load cuda/12.4", "source ~/dsopt/.venv/bin/activate"]
      python: null                # the interpreter of the workers; default: the one running 'dsopt slurm submit'
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from optimizer.study.fields import Section, as_count_text, as_fraction, as_positive_int, as_text, as_text_list, built
from optimizer.study.specs import Accelerator
from optimizer.study.units import parse_count

HEADROOM_CPU = 0.03
"""Default ``budget.headroom`` on CPU ranks: the run-to-run spread measured here between identical runs
(qwen2-tiny ZeRO-3 on 2 CPU ranks: 4.729, 4.860, 4.877 MB per rank, 3 %), the same figure as the launch
margin's :data:`optimizer.search.ordering.MIN_MARGIN`."""

HEADROOM_CUDA = 0.05
"""Default ``budget.headroom`` on CUDA GPUs: an assumption, not a measurement. No GPU has run a dsopt study
yet, so 5 % stands for the caching allocator's run-to-run variation of the reserved peak; replace it by the
spread measured between identical GPU runs once there is one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Headroom:
    """The share of the per-device budget (``hardware.gpu_memory``) the exported pick keeps free, and where
    that value comes from (:meth:`BudgetSettings.headroom_for`)."""

    fraction: float
    """Kept free, as a fraction of ``hardware.gpu_memory`` (0 ≤ fraction < 1; 0: the whole budget is usable)."""
    stated: bool
    """True: ``budget.headroom`` in the study file; False: the default for :attr:`accelerator`."""
    accelerator: Accelerator
    """The study's accelerator (which default applies when not stated)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fraction) and 0 <= self.fraction < 1):
            raise ValueError(f"headroom must be >= 0 and < 1, got {self.fraction!r}")

    @property
    def percent(self) -> str:
        """The fraction as people write it: ``5 %``."""
        return f"{self.fraction * 100:g} %"

    @property
    def basis(self) -> str:
        """Where the value comes from, naming the key that sets it."""
        if self.stated:
            return "stated in budget.headroom"
        where = "GPUs" if self.accelerator is Accelerator.CUDA else "CPU ranks"
        return f"default on {where}; budget.headroom"

    def usable_bytes(self, budget_bytes: int) -> int:
        """Bytes per device a pick may have measured: ``budget_bytes − round(budget_bytes × fraction)``."""
        return budget_bytes - round(budget_bytes * self.fraction)


@dataclass(frozen=True, kw_only=True, slots=True)
class BudgetSettings:
    """How much the whole study may spend, all workers together (``budget``)."""

    max_launches: int | None = None
    """Real DeepSpeed launches — every trial's launches, its retries included, and the FP32 reference's; pruned,
    held and reused trials launch nothing and are free; None: no cap."""
    deadline: datetime | None = None
    """An absolute instant (timezone-aware) after which no launch starts; None: no deadline."""
    max_hours: float | None = None
    """Hours after the study's creation after which no launch starts; None: no limit."""
    headroom: float | None = None
    """Fraction of ``hardware.gpu_memory`` (per device) the exported pick keeps free, 0 ≤ headroom < 1;
    None: not stated, :meth:`headroom_for` gives the accelerator's default (:data:`HEADROOM_CUDA`,
    :data:`HEADROOM_CPU`). The search and the Pareto front are not limited by it; only the pick is."""

    def __post_init__(self) -> None:
        if self.max_launches is not None and self.max_launches < 1:
            raise ValueError("max_launches must be >= 1")
        if self.deadline is not None and self.deadline.tzinfo is None:
            raise ValueError("deadline needs a timezone, e.g. 2026-11-30T07:00:00+00:00")
        if self.max_hours is not None and not self.max_hours > 0:
            raise ValueError("max_hours must be > 0")
        if self.headroom is not None and not (math.isfinite(self.headroom) and 0 <= self.headroom < 1):
            raise ValueError(f"headroom must be >= 0 and < 1 (a fraction of hardware.gpu_memory such as 0.05, or "
                             f"a percentage such as '5 %'), got {self.headroom:g} ({self.headroom * 100:g} %)")

    def headroom_for(self, accelerator: Accelerator) -> Headroom:
        """The headroom that applies on ``accelerator``: the stated one, else that accelerator's default."""
        if self.headroom is not None:
            return Headroom(fraction=self.headroom, stated=True, accelerator=accelerator)
        default = HEADROOM_CUDA if accelerator is Accelerator.CUDA else HEADROOM_CPU
        return Headroom(fraction=default, stated=False, accelerator=accelerator)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSettings:
    """Liveness of workers on a shared storage (``workers``); used by PostgreSQL (Optuna's RDB heartbeat)."""

    heartbeat_s: int = 60
    """Seconds between heartbeats of a running trial (Optuna ``heartbeat_interval``)."""
    grace_s: int = 180
    """Seconds without a heartbeat after which a running trial is failed as stale (Optuna ``grace_period``)."""
    max_retry: int = 2
    """How often a stale trial is put back in the queue (``RetryHeartbeatStaleTrialCallback``)."""

    def __post_init__(self) -> None:
        if self.heartbeat_s < 1:
            raise ValueError("heartbeat_s must be >= 1")
        if self.grace_s <= self.heartbeat_s:
            raise ValueError("grace_s must be larger than heartbeat_s")
        if self.max_retry < 0:
            raise ValueError("max_retry must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmSettings:
    """What ``dsopt slurm submit`` puts in the sbatch script (``slurm``)."""

    partition: str | None = None
    """``--partition``; None: the cluster's default."""
    account: str | None = None
    """``--account``."""
    time: str | None = None
    """``--time`` of each array task (SLURM's format, e.g. ``12:00:00``)."""
    cpus_per_task: int | None = None
    """``--cpus-per-task`` (host threads for data loading, CPU Adam and offload)."""
    mem: str | None = None
    """``--mem`` per node (SLURM's format, ``0`` = all of it)."""
    sbatch: tuple[str, ...] = field(default=())
    """Further sbatch options, verbatim (``--qos=normal``)."""
    setup: tuple[str, ...] = field(default=())
    """Shell lines run before the worker (``module load ...``, activating an environment)."""
    python: str | None = None
    """The workers' Python interpreter; None: the one running ``dsopt slurm submit``."""

    def __post_init__(self) -> None:
        for name in ("partition", "account", "time", "mem"):  # each becomes one '#SBATCH --NAME=VALUE' line
            value = getattr(self, name)
            if value is not None and (not value or any(c.isspace() or not c.isprintable() for c in value)):
                raise ValueError(f"{name} must be one word with no spaces or line breaks (it becomes "
                                 f"'#SBATCH --{name}=...'), got {value!r}")
        if self.python is not None and (not self.python or not self.python.isprintable()):
            raise ValueError(f"python must be an interpreter path on one line, got {self.python!r}")
        for option in self.sbatch:
            if not option.startswith("--") or "\n" in option:
                raise ValueError(f"sbatch expects '--option[=value]' items, got {option!r}")
        if any("\n" in line for line in self.setup):
            raise ValueError("setup takes one shell line per item")


# Reading the sections (optimizer.study.study_file calls these)


def deadline(value: Any) -> datetime:
    if isinstance(value, datetime):  # YAML reads an unquoted ISO 8601 timestamp as a datetime
        moment = value
    else:
        try:
            moment = datetime.fromisoformat(as_text(value))
        except ValueError:
            raise ValueError(f"expected an ISO 8601 instant such as 2026-11-30T07:00:00+00:00, got {value!r}") from None
    if moment.tzinfo is None:
        raise ValueError(f"{value!r} has no timezone; write e.g. 2026-11-30T07:00:00+00:00")
    return moment


SLURM_TIME = re.compile(r"(\d+)(:\d{1,2}){0,2}|(\d+)-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)
"""``--time`` as sbatch(1) accepts it: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
days-hours:minutes, days-hours:minutes:seconds, or UNLIMITED/INFINITE."""


SLURM_MEM = re.compile(r"\d+[KMGT]?", re.IGNORECASE)
"""``--mem`` as sbatch(1) accepts it: a whole number, megabytes unless suffixed K, M, G or T (0: all of it)."""


def sbatch_format(pattern: re.Pattern[str], what: str) -> Callable[[Any], str]:
    """Text (or a whole number) that ``pattern`` matches whole; else why, naming the sbatch format."""
    def parse(value: Any) -> str:
        text = as_count_text(value)
        if not pattern.fullmatch(text):
            raise ValueError(f"{text!r} is not a SLURM {what}")
        return text

    return parse


slurm_time = sbatch_format(SLURM_TIME, "time (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or "
                                          "UNLIMITED; see sbatch --time)")


slurm_mem = sbatch_format(SLURM_MEM, "memory size (a whole number with an optional K, M, G or T suffix, "
                                        "megabytes by default; 0 = all of the node's; see sbatch --mem)")


PERCENT = re.compile(r"([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*%")
"""A percentage as people write it: ``5 %``, ``5%``, ``2.5 %``."""


def headroom(value: Any) -> float:
    """A fraction (``0.05``) or a percentage string (``"5 %"``, ``"5%"``) as a fraction; the range is checked by
    :class:`BudgetSettings`."""
    if isinstance(value, str) and (match := PERCENT.fullmatch(value.strip())):
        return float(match.group(1)) / 100
    try:
        number = as_fraction(value)
    except ValueError:
        raise ValueError(f"expected a fraction of hardware.gpu_memory such as 0.05, or a percentage such as "
                         f"'5 %', got {value!r}") from None
    if 1 < number < 100:
        raise ValueError(f"headroom must be a fraction below 1, got {value!r}; for {number:g} percent write "
                         f"'{number:g} %'")
    return number


def parse_budget(section: Section) -> BudgetSettings:
    return built(section, lambda: BudgetSettings(
        max_launches=section.get("max_launches", as_positive_int, None),
        deadline=section.get("deadline", deadline, None),
        max_hours=section.get("max_hours", as_fraction, None),
        headroom=section.get("headroom", headroom, None),
    ))


def parse_workers(section: Section) -> WorkerSettings:
    defaults = WorkerSettings()
    heartbeat = section.get("heartbeat_s", as_positive_int, defaults.heartbeat_s)
    return built(section, lambda: WorkerSettings(
        heartbeat_s=heartbeat,
        grace_s=section.get("grace_s", as_positive_int, max(defaults.grace_s, 3 * heartbeat)),
        max_retry=section.get("max_retry", parse_count, defaults.max_retry),
    ))


def parse_slurm(section: Section) -> SlurmSettings:
    return built(section, lambda: SlurmSettings(
        partition=section.get("partition", as_text, None),
        account=section.get("account", as_text, None),
        time=section.get("time", slurm_time, None),
        cpus_per_task=section.get("cpus_per_task", as_positive_int, None),
        mem=section.get("mem", slurm_mem, None),
        sbatch=section.get("sbatch", as_text_list, ()),
        setup=section.get("setup", as_text_list, ()),
        python=section.get("python", as_text, None),
    ))
