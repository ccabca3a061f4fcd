"""The launcher's watch on host memory while a trial's ranks run: the facts :mod:`optimizer.results.host_oom` reads.

:class:`HostWatch` wraps one launch. Before and after it reads the kernel's OOM-kill counter — of the
launcher's memory cgroup (v2 ``memory.events``, v1 ``memory.oom_control``: ``oom_kill``), else the system's
(``/proc/vmstat`` ``oom_kill``, Linux ≥ 4.13) — and in between a daemon thread samples every
:data:`SAMPLE_EVERY_S` the host memory in use against its limit in two views, keeping the sample closest to
its limit:

* the machine: ``MemTotal − MemAvailable`` of ``MemTotal`` (``/proc/meminfo``; ``MemAvailable`` already
  counts reclaimable page cache as available, Linux ``Documentation/filesystems/proc.rst``);
* the cgroup, where it has a limit: ``memory.current − inactive_file`` of ``memory.max`` (v1:
  ``memory.usage_in_bytes − total_inactive_file`` of ``memory.limit_in_bytes``) — the working set kubelet
  evicts on, since inactive file pages are reclaimed before anything is killed.

Only this node is watched: on a multi-node launch the other nodes' kills are not seen. Anything unreadable
(not Linux, no cgroup files) is None, never an error. The file parsers are pure.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from optimizer.results.host_oom import HostMemoryEvidence

SAMPLE_EVERY_S = 0.2
"""Seconds between host-memory samples (a read of two or three small ``/proc``/cgroup files)."""
PROC_MEMINFO = Path("/proc/meminfo")
PROC_VMSTAT = Path("/proc/vmstat")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_MOUNT = Path("/sys/fs/cgroup")
UNLIMITED_V1 = 2**62
"""cgroup v1 reports "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 on 4 KiB pages); any limit this
large is none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryCgroup:
    """The memory cgroup this process is in."""

    path: Path
    """Its folder under the cgroup mount."""
    v2: bool
    """Unified hierarchy (v2) or the v1 ``memory`` controller."""


def memory_cgroup(proc_self_cgroup: str, *, mount: Path = CGROUP_MOUNT) -> MemoryCgroup | None:
    """Where this process's memory cgroup would be, from ``/proc/self/cgroup`` (pure): the v1 ``memory``
    controller's line (``4:memory:/a/b`` → ``<mount>/memory/a/b``) if there is one, else the v2 line
    (``0::/a/b`` → ``<mount>/a/b``)."""
    v2 = None
    for line in proc_self_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path:
            continue
        relative = path.lstrip("/")
        if "memory" in controllers.split(","):
            return MemoryCgroup(path=mount / "memory" / relative, v2=False)
        if hierarchy == "0" and controllers == "":
            v2 = MemoryCgroup(path=mount / relative, v2=True)
    return v2


def keyed_counts(text: str) -> dict[str, int]:
    """``key value`` lines (``memory.events``, ``memory.stat``, ``memory.oom_control``, ``/proc/vmstat``) as a
    dict; lines that are not one key and one integer are skipped (pure)."""
    counts = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("-").isdigit():
            counts[fields[0]] = int(fields[1])
    return counts


def meminfo_bytes(text: str) -> dict[str, int]:
    """``/proc/meminfo`` (``MemTotal:  24683584 kB``) in bytes (the kernel's kB are KiB) (pure)."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[key.strip()] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return values


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    return int(text) if text is not None and text.strip().isdigit() else None


def find_memory_cgroup() -> MemoryCgroup | None:
    """This process's memory cgroup, if its folder can be read here."""
    text = _read(PROC_SELF_CGROUP)
    cgroup = memory_cgroup(text) if text is not None else None
    return cgroup if cgroup is not None and cgroup.path.is_dir() else None


def oom_kill_count(cgroup: MemoryCgroup | None) -> tuple[int | None, str]:
    """The kernel's OOM-kill counter: the cgroup's, else the system's; with where it was read."""
    if cgroup is not None:
        path = cgroup.path / ("memory.events" if cgroup.v2 else "memory.oom_control")
        text = _read(path)
        if text is not None and "oom_kill" in (counts := keyed_counts(text)):
            return counts["oom_kill"], str(path)
    text = _read(PROC_VMSTAT)
    if text is not None and "oom_kill" in (counts := keyed_counts(text)):
        return counts["oom_kill"], str(PROC_VMSTAT)
    return None, ""


def memory_in_use(cgroup: MemoryCgroup | None) -> tuple[int, int] | None:
    """(bytes in use, limit) of the view closest to its limit now (module doc), or None."""
    views = []
    text = _read(PROC_MEMINFO)
    info = meminfo_bytes(text) if text is not None else {}
    total = info.get("MemTotal")
    if total and "MemAvailable" in info:
        views.append((total - info["MemAvailable"], total))
    if cgroup is not None:
        names = ("memory.current", "memory.max", "inactive_file") if cgroup.v2 else \
            ("memory.usage_in_bytes", "memory.limit_in_bytes", "total_inactive_file")
        usage, limit = _read_int(cgroup.path / names[0]), _read_int(cgroup.path / names[1])  # v2 "max": None
        stat = keyed_counts(_read(cgroup.path / "memory.stat") or "")
        if usage is not None and limit is not None and limit < UNLIMITED_V1 and (total is None or limit < total):
            views.append((max(0, usage - stat.get(names[2], 0)), limit))
    return max(views, key=lambda view: view[0] / view[1]) if views else None


class HostWatch:
    """``with HostWatch() as watch: <launch>`` then :meth:`evidence` (module doc)."""

    def __init__(self, *, every_s: float = SAMPLE_EVERY_S) -> None:
        self._every_s = every_s
        self._cgroup = find_memory_cgroup()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="dsopt-host-watch", daemon=True)
        self._closest: tuple[int, int] | None = None
        self._samples = 0
        self._kills_before: int | None = None
        self._kills_after: int | None = None
        self._source = ""

    def _sample(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            view = memory_in_use(self._cgroup)
            if view is not None:
                self._samples += 1
                if self._closest is None or view[0] / view[1] > self._closest[0] / self._closest[1]:
                    self._closest = view

    def _sample_until_stopped(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._every_s)

    def __enter__(self) -> HostWatch:
        self._kills_before, self._source = oom_kill_count(self._cgroup)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self._kills_after, _ = oom_kill_count(self._cgroup)

    def evidence(self) -> HostMemoryEvidence:
        """What was seen over the launch (call after the ``with`` block)."""
        kills = None
        if self._kills_before is not None and self._kills_after is not None:
            kills = max(0, self._kills_after - self._kills_before)
        used, limit = self._closest if self._closest is not None else (None, None)
        return HostMemoryEvidence(oom_kills=kills, oom_kills_source=self._source, peak_used_bytes=used,
                                  limit_bytes=limit, samples=self._samples)
