"""One function over many items on every CPU this process may use: this process and forked copies of it, each
taking the next item in turn, so a study's traces run side by side without a fresh interpreter's imports.

Why fork. A trace is one Python thread of fake-tensor dispatch, so only separate processes run two at once. A
fresh interpreter (``spawn``) imports torch, transformers and PEFT before its first trace — 7–9 s of CPU on this
project's 2-core machine, more than a handful of traces take. A forked copy shares what this process imported
(copy on write) and starts in milliseconds: the two shallow copies of one deep model (the 7B LoRA plan's one
candidate) trace at once.

When not. Fork copies one thread only, so a lock that another thread held at the fork stays held in the copy
forever: with more than one Python thread alive, or on a platform without ``fork`` (anything but Linux here:
macOS's system libraries are not fork-safe), everything runs in this process, in order, as if ``workers`` were 1.
A copy sets torch's intra-op threads to one, as a ``torch.utils.data`` worker does (``_worker_loop``): GNU
OpenMP's pool does not survive a fork. Fake tensors compute nothing, so nothing measured depends on it.

What a copy computed comes back pickled through a pipe when it has no item left; it ends with ``os._exit``
(no ``atexit`` handler, no second flush of this process's buffers, no final collection). An item a copy could not
finish — it raised, or the copy died — is computed again here, where its exception, if any, is raised as it
would be without copies. A copy still running when this process stops (an exception, Ctrl-C) is killed, and one
dies with it (a parent-death signal). Native threads (OpenMP's pool, a driver's) are not Python threads: a copy
stuck on a lock one of them held at the fork is killed past a deadline (:data:`WAIT_FACTOR`) and its items are
computed here, as they are when there are more items than the queue pipe holds.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from launchers.process.orphan_guard import die_with_parent

T = TypeVar("T")
R = TypeVar("R")

_TOKEN = struct.Struct("=I")
"""One item's index in the queue pipe. Every token is written before the first fork and each read asks for one
token's bytes: Linux reads a pipe under its lock, so a read takes one whole token or, once the pipe is empty and
every write end closed, nothing (``pipe(7)``)."""


def stop_progress_monitor() -> None:
    """Stop tqdm's monitor threads, if any run, and start no other (``monitor_interval = 0``, tqdm's own switch,
    ``tqdm/std.py``). tqdm starts one per bar class with its first progress bar — transformers' ``from_pretrained``
    shows one, of its own subclass — and each then lives as long as the process, only to adjust the ``miniters`` of
    slow bars: a planning process would never fork again after one bar. ``TMonitor.exit`` joins it; tqdm not
    imported: nothing to stop."""
    tqdm_std = sys.modules.get("tqdm.std")
    if tqdm_std is None:
        return
    from tqdm._monitor import TMonitor

    tqdm_std.tqdm.monitor_interval = 0  # subclasses inherit it
    for thread in threading.enumerate():
        if isinstance(thread, TMonitor) and thread.is_alive():
            thread.tqdm_cls.monitor_interval = 0
            thread.exit()
            thread.tqdm_cls.monitor = None


def fork_safe() -> bool:
    """Whether copies may be forked now: Linux, and this process's only Python thread (module doc) once tqdm's
    monitor is stopped (:func:`stop_progress_monitor`)."""
    if not (sys.platform.startswith("linux") and hasattr(os, "fork")):
        return False
    if threading.active_count() > 1:
        stop_progress_monitor()
    return threading.active_count() == 1


def shared_map(fn: Callable[[T], R], items: Sequence[T], *, workers: int) -> list[R]:
    """``[fn(item) for item in items]``, in order, computed by this process and up to ``workers`` − 1 forked
    copies of it (module doc); in this process alone when there is one item, one worker, no safe fork, or more
    items than the queue pipe holds."""
    copies = min(workers, len(items)) - 1
    if copies < 1 or not fork_safe():
        return [fn(item) for item in items]
    queue_read, queue_write = os.pipe()
    if len(items) * _TOKEN.size > fcntl.fcntl(queue_write, fcntl.F_GETPIPE_SZ):  # written whole before any read
        os.close(queue_read)
        os.close(queue_write)
        return [fn(item) for item in items]
    os.write(queue_write, b"".join(_TOKEN.pack(index) for index in range(len(items))))
    os.close(queue_write)
    children: list[tuple[int, int]] = []
    done: dict[int, R] = {}
    try:
        parent = os.getpid()
        for _ in range(copies):
            read, write = os.pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # no Ctrl-C between fork and _serve
            try:
                pid = os.fork()
                if pid == 0:  # the copy: never returns
                    _serve(fn, items, queue_read, write, inherited=[read, *(r for _, r in children)],
                           mask=previous, parent=parent)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            os.close(write)
            children.append((pid, read))
        start = time.monotonic()
        for index in _claims(queue_read):
            done[index] = fn(items[index])
        wait_s = max(WAIT_FLOOR_S, WAIT_FACTOR * (time.monotonic() - start))
        while children:
            pid, read = children[0]
            done.update(_collected(pid, read, deadline=time.monotonic() + wait_s))
            children.pop(0)
            os.close(read)
    finally:
        os.close(queue_read)
        for pid, read in children:  # stopped early: the copies still running are killed
            os.close(read)
            _kill(pid)
    return [done[index] if index in done else fn(items[index]) for index in range(len(items))]


WAIT_FLOOR_S = 120.0
WAIT_FACTOR = 4.0
"""How long this process waits for a copy once its own items are done: ``WAIT_FACTOR`` times as long as it took
over them, at least ``WAIT_FLOOR_S`` — a copy past that is taken for stuck (a lock a native thread held at the fork),
killed, and its items computed here."""


def _claims(queue_read: int) -> Iterator[int]:
    """The indices this process takes from the queue, one at a time, until it is empty."""
    while len(token := os.read(queue_read, _TOKEN.size)) == _TOKEN.size:
        yield _TOKEN.unpack(token)[0]


def _serve(fn: Callable[[T], R], items: Sequence[T], queue_read: int, write: int, *, inherited: list[int],
           mask: set[signal.Signals], parent: int) -> None:
    """A copy's life: take items until none is left, send what it computed, end without cleaning up; it ends with
    this process too (a parent-death signal) and never returns into the caller's frames."""
    status = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a copy at once; this process redoes its items
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for fd in inherited:  # this copy's read end, and the older copies'
            os.close(fd)
        die_with_parent(signal.SIGKILL, parent_pid=parent)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)
        results = {}
        for index in _claims(queue_read):
            try:
                results[index] = fn(items[index])
            except Exception:  # left out: this process computes it again and raises it there
                continue
        with os.fdopen(write, "wb") as stream:
            pickle.dump(results, stream, protocol=pickle.HIGHEST_PROTOCOL)
        status = 0
    finally:
        os._exit(status)


def _collected(pid: int, read: int, *, deadline: float) -> dict:
    """What the copy ``pid`` sent through ``read`` (nothing, if it died before sending, or is killed at ``deadline``),
    once it has ended."""
    chunks = []
    while (left := deadline - time.monotonic()) > 0 and select.select([read], [], [], left)[0]:
        chunk = os.read(read, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    else:
        _kill(pid)  # stuck past the deadline: its items are computed here
        return {}
    os.waitpid(pid, 0)
    try:
        return pickle.loads(b"".join(chunks)) if chunks else {}
    except Exception:  # cut short (it died mid-send): its items are computed here
        return {}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
