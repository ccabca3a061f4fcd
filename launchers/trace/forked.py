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
would be without copies. A copy still running when this process stops (an exception, Ctrl-C) is killed.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_TOKEN = struct.Struct("=I")
"""One item's index in the queue pipe. Every token is written before the first fork and each read asks for one
token's bytes: Linux reads a pipe under its lock, so a read takes one whole token or, once the pipe is empty and
every write end closed, nothing (``pipe(7)``)."""


def fork_safe() -> bool:
    """Whether copies may be forked now: Linux, and this process's only Python thread (module doc)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and threading.active_count() == 1


def shared_map(fn: Callable[[T], R], items: Sequence[T], *, workers: int) -> list[R]:
    """``[fn(item) for item in items]``, in order, computed by this process and up to ``workers`` − 1 forked
    copies of it (module doc); in this process alone when there is one item, one worker, or no safe fork."""
    copies = min(workers, len(items)) - 1
    if copies < 1 or not fork_safe():
        return [fn(item) for item in items]
    queue_read, queue_write = os.pipe()
    os.write(queue_write, b"".join(_TOKEN.pack(index) for index in range(len(items))))
    os.close(queue_write)
    children: list[tuple[int, int]] = []
    done: dict[int, R] = {}
    try:
        for _ in range(copies):
            read, write = os.pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the copy: never returns
                os.close(read)
                _serve(fn, items, queue_read, write)
            os.close(write)
            children.append((pid, read))
        for index in _claims(queue_read):
            done[index] = fn(items[index])
        while children:
            pid, read = children.pop(0)
            done.update(_collected(pid, read))
    finally:
        os.close(queue_read)
        for pid, read in children:  # stopped early: the copies still running are killed
            os.close(read)
            _kill(pid)
    return [done[index] if index in done else fn(items[index]) for index in range(len(items))]


def _claims(queue_read: int) -> Iterator[int]:
    """The indices this process takes from the queue, one at a time, until it is empty."""
    while len(token := os.read(queue_read, _TOKEN.size)) == _TOKEN.size:
        yield _TOKEN.unpack(token)[0]


def _serve(fn: Callable[[T], R], items: Sequence[T], queue_read: int, write: int) -> None:
    """A copy's life: take items until none is left, send what it computed, end without cleaning up."""
    status = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a copy at once; this process redoes its items
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


def _collected(pid: int, read: int) -> dict:
    """What the copy ``pid`` sent (nothing, if it died before sending), once it has ended."""
    with os.fdopen(read, "rb") as stream:
        data = stream.read()
    os.waitpid(pid, 0)
    try:
        return pickle.loads(data) if data else {}
    except (pickle.UnpicklingError, EOFError):  # cut short: its items are computed here
        return {}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
