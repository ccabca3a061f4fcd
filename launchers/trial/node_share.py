"""A worker's share of its node: its slice of the GPUs and the CPUs it may really use.

Several workers may run on one node (``dsopt worker --slot K`` started by hand, or ``srun --ntasks-per-node``
tasks inside one allocation). Each takes its own contiguous **GPU slice**: worker ``K`` of a study whose
trials need ``g`` GPUs gets the node's visible GPUs ``K·g … K·g+g-1`` as ``CUDA_VISIBLE_DEVICES``. Where
the index comes from (:func:`worker_slot`):

* ``dsopt worker --slot K`` (or ``K/N``: worker ``K`` of ``N`` sharing the node) — explicit, first;
* inside an ``srun`` step (``$SLURM_STEP_ID`` set) without per-task GPU binding: ``$SLURM_LOCALID``, SLURM's
  "node local task ID for the process within a job" (srun(1), OUTPUT ENVIRONMENT VARIABLES), and the
  step's task count on this node from ``$SLURM_STEP_TASKS_PER_NODE`` (e.g. ``4(x2),2``) at
  ``$SLURM_NODEID``;
* otherwise 0. A ``dsopt slurm submit`` job array is this case: each array task is a job of its own whose
  GPUs SLURM already confines with ``--gpus-per-node`` (``CUDA_VISIBLE_DEVICES`` set by its GRES plugin),
  so slot 0 of what the job sees is right even when two array tasks share a machine. With
  ``--gpus-per-task`` (``$SLURM_GPUS_PER_TASK``) SLURM binds GPUs to each task itself (implied
  ``--gpu-bind=per_task``, SLURM ≥ 21.08), so the slot is 0 there too.

An existing ``CUDA_VISIBLE_DEVICES`` is respected: slices are cut from it, never from the physical list.

The **CPU allowance** is what the process may run on, not ``os.cpu_count()`` (every CPU of the machine):
its affinity mask (``os.sched_getaffinity(0)``; SLURM's task/affinity and cpuset cgroups shrink it),
further capped by a cgroup v2 CPU bandwidth quota (``cpu.max``: ``"max 100000"`` = no limit,
``"200000 100000"`` = 2 CPUs; Linux ``Documentation/admin-guide/cgroup-v2.rst``, "cpu.max"), rounded up
as Go 1.25's container-aware ``GOMAXPROCS`` does (golang/go#73193). The tightest quota of the process's
cgroup and every cgroup above it counts — the kernel enforces a parent's limit too, which Go's leaf-only
reading misses (golang/go#81180).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from optimizer.study.errors import UserError

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the cgroup v2 hierarchy is mounted (the process's own cgroup inside a cgroup namespace)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSlot:
    """Which share of its node's GPUs a worker takes."""

    index: int
    """0-based position of this worker among the workers sharing the node."""
    workers_on_node: int | None
    """How many workers share the node, when known (``--slot K/N``, a SLURM step); None: unknown."""
    source: str
    """Where the index came from, for messages: ``--slot``, ``$SLURM_LOCALID`` or ``default``."""

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError("index must be >= 0")
        if self.workers_on_node is not None and not 0 <= self.index < self.workers_on_node:
            raise ValueError(f"index {self.index} is outside 0..{self.workers_on_node - 1}")


DEFAULT_SLOT = WorkerSlot(index=0, workers_on_node=None, source="default")
"""A lone worker: the first GPUs it sees."""


def parse_slot(text: str) -> WorkerSlot:
    """``--slot K`` or ``--slot K/N`` (worker K of N on this node, K from 0); ValueError names the form."""
    match = re.fullmatch(r"(\d+)(?:/(\d+))?", text.strip())
    if not match:
        raise ValueError(f"expected K or K/N (worker K of N on this node, K from 0), got {text!r}")
    index = int(match[1])
    workers = int(match[2]) if match[2] is not None else None
    if workers is not None and not index < workers:
        raise ValueError(f"slot {index} of {workers}: K must be below N (K counts from 0)")
    return WorkerSlot(index=index, workers_on_node=workers, source="--slot")


def tasks_on_node(tasks_per_node: str, node_id: int) -> int | None:
    """The entry for node ``node_id`` of SLURM's compressed per-node task counts (``"4(x2),2"`` → 4, 4, 2);
    None when the text does not parse or has no such node."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts[node_id] if 0 <= node_id < len(counts) else None


def worker_slot(*, explicit: WorkerSlot | None, env: Mapping[str, str]) -> WorkerSlot:
    """This worker's slot: ``explicit`` (``--slot``) first, then an srun step's ``$SLURM_LOCALID``, else 0
    (module doc for why a job array's tasks are slot 0)."""
    if explicit is not None:
        return explicit
    local = env.get("SLURM_LOCALID", "")
    if "SLURM_STEP_ID" not in env or env.get("SLURM_GPUS_PER_TASK") or not local.isdigit():
        return DEFAULT_SLOT
    node = env.get("SLURM_NODEID", "")
    workers = tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""), int(node)) if node.isdigit() else None
    if workers is not None and int(local) >= workers:
        workers = None  # inconsistent environment: trust the index, not the count
    return WorkerSlot(index=int(local), workers_on_node=workers, source="$SLURM_LOCALID")


def visible_gpus(*, cuda_visible: str | None, device_count: int) -> tuple[str, ...]:
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` entries (indices, ``GPU-<uuid>``, ``MIG-…``).

    Unset: ``0 … device_count-1``. Set: its entries, cut to ``device_count`` (CUDA ignores everything from
    the first invalid entry on, and ``torch.cuda.device_count()`` counts what is left)."""
    if cuda_visible is None:
        return tuple(str(i) for i in range(device_count))
    entries = [entry.strip() for entry in cuda_visible.split(",") if entry.strip()]
    return tuple(entries[:device_count])


def gpu_slice(*, visible: Sequence[str], gpus_per_trial: int, slot: WorkerSlot) -> tuple[str, ...]:
    """The ``CUDA_VISIBLE_DEVICES`` entries of ``slot`` (pure): ``visible[K·g : K·g+g]``.

    UserError when the slices of the workers sharing the node would overlap (``N·g`` above the visible
    GPUs) or this slice runs past them."""
    g, n = gpus_per_trial, len(visible)
    shown = ",".join(visible) or "none"
    if slot.workers_on_node is not None and slot.workers_on_node * g > n:
        raise UserError(source=slot.source, key=f"{slot.index}/{slot.workers_on_node}",
                        why=f"{slot.workers_on_node} workers x {g} GPU(s) per trial need "
                            f"{slot.workers_on_node * g} GPUs; this node shows {n} ({shown}): their slices would "
                            f"overlap (room for {n // g} worker(s))")
    first = slot.index * g
    if first + g > n:
        room = f"slots 0..{n // g - 1} ({n // g} worker(s) of {g} GPU(s))" if n >= g else "no slot"
        raise UserError(source=slot.source, key=str(slot.index),
                        why=f"slot {slot.index} needs visible GPUs {first}..{first + g - 1}; this node shows {n} "
                            f"({shown}): room for {room}")
    return tuple(visible[first:first + g])


def parse_cpu_max(text: str) -> float | None:
    """CPUs granted by a cgroup v2 ``cpu.max`` line ``"QUOTA PERIOD"`` (µs each): ``QUOTA / PERIOD``; None
    for ``"max …"`` (no limit). ValueError on anything else."""
    fields = text.split()
    if not 1 <= len(fields) <= 2:
        raise ValueError(f"cpu.max: expected 'QUOTA PERIOD', got {text!r}")
    if fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) == 2 else 100_000  # the kernel's default period
    except ValueError:
        raise ValueError(f"cpu.max: expected integers or 'max', got {text!r}") from None
    if quota <= 0 or period <= 0:
        raise ValueError(f"cpu.max: quota and period must be positive, got {text!r}")
    return quota / period


def cgroup_dirs(proc_self_cgroup: str) -> list[str]:
    """The process's cgroup v2 path and every cgroup above it, innermost first, from ``/proc/self/cgroup``
    (the ``0::/a/b`` line → ``/a/b``, ``/a``, ``/``); empty without a v2 line."""
    for line in proc_self_cgroup.splitlines():
        if line.startswith("0::"):
            path = Path(line[3:].strip() or "/")
            return [str(p) for p in (path, *path.parents)]
    return []


def cpu_allowance(*, affinity: int, quotas: Sequence[float | None]) -> int:
    """CPUs a process may use (pure): its affinity, capped by the tightest cgroup quota rounded up; >= 1."""
    limits = [math.ceil(q) for q in quotas if q is not None]
    return max(1, min([affinity, *limits]))


def read_cpu_allowance() -> int:
    """:func:`cpu_allowance` of this process: ``os.sched_getaffinity(0)`` (``os.cpu_count()`` where the OS has
    no affinity call) and the ``cpu.max`` of its cgroup, the cgroups above it and ``/sys/fs/cgroup`` itself
    (a container's own cgroup); unreadable or malformed files count as no limit."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        dirs = cgroup_dirs(Path("/proc/self/cgroup").read_text())
    except OSError:
        dirs = []
    quotas: list[float | None] = []
    for folder in dict.fromkeys([*dirs, "/"]):
        try:
            quotas.append(parse_cpu_max((CGROUP_ROOT / folder.lstrip("/") / "cpu.max").read_text()))
        except (OSError, ValueError):
            continue
    return cpu_allowance(affinity=affinity, quotas=quotas)
