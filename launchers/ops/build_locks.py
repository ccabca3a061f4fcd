"""JIT-build locks left by killed ranks: remove only those whose owner is provably dead on this node.

torch's ``cpp_extension.load`` takes ``<TORCH_EXTENSIONS_DIR>/<py…>/<op>/lock`` (a ``FileBaton``: an empty file
created with ``O_CREAT | O_EXCL``, its descriptor kept open until the build ends) on every load, even of a
cached op, and every other process — on any node sharing the folder — spins until the file disappears
(``torch/utils/file_baton.py``). A rank killed while holding it (SIGTERM or SIGKILL skip the ``finally`` that
releases it) hangs every later trial. The file records no owner, so dsopt records one: while a launch runs,
:func:`record_lock_owners` notes which of its processes holds each lock open (``/proc/<pid>/fd``) in
``<op>/lock.owner`` — host name, boot id, PID namespace, pid and the process's start time, and the lock's
inode and mtime so that the record never applies to a later lock of the same path.

The rule (:func:`lock_verdict`), for a lock nobody on this node holds open or builds in:

* recorded owner on this node (same host name, boot id and PID namespace): removed once that process is gone
  (no live pid with the recorded start time); a different boot id means the node rebooted since — gone too;
* anything else — owner on another host, in another PID namespace, no record (a lock taken before dsopt
  looked, by another program, or by a rank on another node of a multi-node trial): left alone unless it is
  older than :data:`FOREIGN_LOCK_S`, far longer than any op build takes (minutes), since the owner may be
  building right now on another node and removing its lock would let two builds write one folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

FOREIGN_LOCK_S = 3600.0
"""A lock whose owner cannot be shown dead on this node is removed only this old (s): an hour, several times
the longest DeepSpeed op build (minutes); the lock's mtime is its creation, ``FileBaton`` never touches it."""
OWNER_SUFFIX = ".owner"
"""The owner record beside a lock: ``<op>/lock.owner``."""
LOCK_GLOBS = ("*/lock", "*/*/lock")
"""Locks under the extensions root: ``<op>/lock`` when ``TORCH_EXTENSIONS_DIR`` is set — which every dsopt launch
does (launchers/trial/local.py) — and ``<py311_cu124>/<op>/lock`` under torch's default root, which adds that folder
only when the variable is unset (``torch/utils/cpp_extension.py`` ``_get_build_directory``)."""


def build_locks(root: Path) -> list[Path]:
    """Every JIT-build lock under ``root`` (:data:`LOCK_GLOBS`)."""
    if not root.is_dir():
        return []
    return [lock for pattern in LOCK_GLOBS for lock in root.glob(pattern)]


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeIdentity:
    """Which processes a node can see: a pid means the same process only under the same three values."""

    host: str
    """``socket.gethostname()``."""
    boot_id: str
    """``/proc/sys/kernel/random/boot_id``: changes at every boot."""
    pid_ns: str
    """``readlink /proc/self/ns/pid`` (``pid:[4026531836]``): containers on one host see different pids."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LockOwner:
    """The process that held a lock, as recorded in ``lock.owner``."""

    host: str
    """Host name of the holder's node."""
    boot_id: str
    """That node's boot id when the holder ran."""
    pid_ns: str
    """The holder's PID namespace."""
    pid: int
    """The holder's pid."""
    start_ticks: int
    """The holder's start time, field 22 of ``/proc/<pid>/stat`` (clock ticks after boot): a reused pid
    has another."""
    lock_ino: int
    """Inode of the lock file it held."""
    lock_mtime_ns: int
    """mtime of that lock file (ns)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ObservedLock:
    """What this node can see of one lock file."""

    age_s: float
    """Seconds since the lock's mtime (its creation)."""
    ino: int
    """Its inode."""
    mtime_ns: int
    """Its mtime (ns)."""
    busy_here: bool
    """A process of this node holds it open or works in its folder (a compiler)."""
    owner: LockOwner | None
    """The record beside it, if any (perhaps of an earlier lock of the same path)."""
    owner_start_now: int | None
    """Start time of the process that now has the recorded pid on this node; None: no such process."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LockVerdict:
    """Whether to remove a lock, and why."""

    remove: bool
    """Remove it."""
    why: str
    """One line."""


def lock_verdict(lock: ObservedLock, *, node: NodeIdentity, foreign_after_s: float = FOREIGN_LOCK_S) -> LockVerdict:
    """The module doc's rule (pure)."""
    if lock.busy_here:
        return LockVerdict(remove=False, why="a process of this node holds it or builds in its folder")
    owner = lock.owner
    if owner is not None and (owner.lock_ino, owner.lock_mtime_ns) != (lock.ino, lock.mtime_ns):
        owner = None  # the record of an earlier lock at this path
    if owner is not None and (owner.host, owner.pid_ns) == (node.host, node.pid_ns):
        if owner.boot_id != node.boot_id:
            return LockVerdict(remove=True, why=f"its owner (pid {owner.pid}) ran before this node rebooted")
        if lock.owner_start_now == owner.start_ticks:
            return LockVerdict(remove=False, why=f"its owner (pid {owner.pid}) is alive on this node")
        return LockVerdict(remove=True, why=f"its owner (pid {owner.pid}) is dead on this node")
    whose = "no recorded owner" if owner is None else f"owner pid {owner.pid} on {owner.host}"
    if lock.age_s > foreign_after_s:
        return LockVerdict(remove=True, why=f"{whose}, and {lock.age_s:.0f} s old (> {foreign_after_s:.0f} s)")
    return LockVerdict(remove=False, why=f"{whose}: it may be in use elsewhere; kept until "
                                         f"{foreign_after_s:.0f} s old")


def parse_owner(text: str) -> LockOwner | None:
    """A ``lock.owner`` record; None if it is not one."""
    try:
        data = json.loads(text)
        return LockOwner(host=str(data["host"]), boot_id=str(data["boot_id"]), pid_ns=str(data["pid_ns"]),
                         pid=int(data["pid"]), start_ticks=int(data["start_ticks"]), lock_ino=int(data["lock_ino"]),
                         lock_mtime_ns=int(data["lock_mtime_ns"]))
    except (ValueError, TypeError, KeyError):
        return None


def this_node() -> NodeIdentity:
    """This process's :class:`NodeIdentity`."""
    boot_id = pid_ns = ""
    with contextlib.suppress(OSError):
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with contextlib.suppress(OSError):
        pid_ns = os.readlink("/proc/self/ns/pid")
    return NodeIdentity(host=socket.gethostname(), boot_id=boot_id, pid_ns=pid_ns)


def start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time after boot, clock ticks); None if no such process."""
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _holders(pids: Iterable[int]) -> dict[str, int]:
    """Open files of ``pids`` (resolved paths) → the pid holding each."""
    held: dict[str, int] = {}
    for pid in pids:
        fd_dir = Path("/proc") / str(pid) / "fd"
        with contextlib.suppress(OSError):
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    held[os.readlink(fd)] = pid
    return held


def _processes() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def record_lock_owners(root: Path, *, pids: Callable[[], Iterable[int]], node: NodeIdentity | None = None) -> int:
    """Write ``lock.owner`` for every lock under ``root`` held open by one of ``pids()`` (called only when a lock
    exists, so a launch pays for the ``/proc`` scan only while an op is being built); returns how many."""
    locks = build_locks(root)
    if not locks:
        return 0
    held = _holders(pids())
    node = node or this_node()
    written = 0
    for lock in locks:
        with contextlib.suppress(OSError):
            pid = held.get(os.path.realpath(lock))
            ticks = start_ticks(pid) if pid is not None else None
            if pid is None or ticks is None:
                continue
            stat = lock.stat()
            owner = LockOwner(host=node.host, boot_id=node.boot_id, pid_ns=node.pid_ns, pid=pid, start_ticks=ticks,
                              lock_ino=stat.st_ino, lock_mtime_ns=stat.st_mtime_ns)
            record = lock.with_name(lock.name + OWNER_SUFFIX)
            if record.exists() and parse_owner(record.read_text()) == owner:
                continue
            tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(asdict(owner), sort_keys=True) + "\n")
            tmp.replace(record)
            written += 1
    return written


def clear_stale_build_locks(root: Path, *, foreign_after_s: float = FOREIGN_LOCK_S,
                            node: NodeIdentity | None = None) -> list[Path]:
    """Remove the locks under ``root`` that :func:`lock_verdict` condemns (and their records); returns them."""
    removed: list[Path] = []
    locks = build_locks(root)
    if not locks:
        return removed
    node = node or this_node()
    pids = _processes()
    held = _holders(pids)
    busy: list[Path] = []
    for pid in pids:
        with contextlib.suppress(OSError):
            busy.append(Path(os.readlink(Path("/proc") / str(pid) / "cwd")))
    now = time.time()
    for lock in locks:
        with contextlib.suppress(OSError):
            stat = lock.stat()
            folder = Path(os.path.realpath(lock.parent))
            record = lock.with_name(lock.name + OWNER_SUFFIX)
            owner = parse_owner(record.read_text()) if record.exists() else None
            observed = ObservedLock(
                age_s=now - stat.st_mtime, ino=stat.st_ino, mtime_ns=stat.st_mtime_ns,
                busy_here=os.path.realpath(lock) in held or any(p == folder or folder in p.parents for p in busy),
                owner=owner, owner_start_now=start_ticks(owner.pid) if owner is not None else None)
            if not lock_verdict(observed, node=node, foreign_after_s=foreign_after_s).remove:
                continue
            again = lock.stat()
            if (again.st_ino, again.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns):  # not a new lock meanwhile
                lock.unlink()
                removed.append(lock)
                with contextlib.suppress(OSError):
                    record.unlink()
    return removed


@contextlib.contextmanager
def node_lock(path: Path, *, holder: str, say: Callable[[str], None], doing: str) -> Iterator[float]:
    """Hold an exclusive ``flock`` on ``path`` (its text names the holder); yields the seconds waited for it. The
    kernel releases an ``flock`` when its holder dies, so this lock cannot go stale. ``doing``: what the holder does
    (said while waiting: 'building DeepSpeed ops', 'probing the machine')."""
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            other = handle.read().strip() or "another worker"
            say(f"waiting for {other} to finish {doing} on this node ({path})")
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        waited_s = time.monotonic() - start
        handle.truncate(0)
        handle.write(holder + "\n")
        handle.flush()
        try:
            yield waited_s
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
