"""Python's cyclic garbage collector in dsopt's own processes (the ``dsopt`` command and the copies it forks to
trace, the rank programs, a trial's torchrun): fewer collections where nothing is measured, and none at their exit.

Two costs of CPython 3.11's collector (``Modules/gcmodule.c``), both paid by every process that imports torch,
DeepSpeed, transformers and PEFT — hundreds of thousands of long-lived module objects:

* **While it imports and plans.** A young collection runs every 700 net allocations (``gc.get_threshold()``'s
  default), and every 100 of them a full one walks the whole heap. Importing peft, transformers, torch._dynamo and
  DeepSpeed ran 1,185 collections, 2.2 s of 11 s on this project's 2-core machine (measured with ``gc.callbacks``).
* **At its exit.** ``Py_FinalizeEx`` runs one more full collection (``_PyGC_CollectNoFail`` in
  ``finalize_modules``), ~2 s in a process that imported the compiler stack, 0.6 s after ``import torch`` alone.
  ``gc.freeze()`` first moves every object into the permanent generation, which no collection walks: the exit
  takes ~0.3 s. What runs at exit is unchanged — ``atexit`` handlers and ``weakref.finalize`` callbacks (the
  temporary folders, the multiprocessing pools) run before it; only objects that nothing but a reference cycle
  holds are left to the operating system instead of being collected.

A trial's rank keeps the default thresholds: its live-tensor peak (:mod:`launchers.measure.cpu_memory`) must be the
one a run without dsopt has, and a tensor held by a reference cycle is freed when a collection finds it. Once its
report is written and its process group torn down, a rank program ends at once (:func:`end_rank`): no ``atexit``
handler, no interpreter finalization, no C++ static destructor. Processes that measure no real
tensor — the ``dsopt`` command itself (planning, the study loop) — also collect less often
(:func:`for_planning`), except while they trace: a trace measures liveness as a run does (fake storages freed
when nothing holds them, ``torch.distributed._tools.mem_tracker`` and ``launchers/trace/tracer.py`` through weak
references), so it runs under the default thresholds (:func:`default_thresholds`) — the copies forked to trace
beside it too (forked inside that block, :mod:`launchers.trace.forked`; they end with ``os._exit``). A trial's
launcher, torchrun, is started as ``python -m launchers.process.collector torch.distributed.run ARGS`` (:func:`main`):
torchrun's own code, no collection at its exit, which a trial waits for. A user's script trial is left as it is
(its hook ends the process with ``os._exit`` already: :mod:`launchers.rank.script_hook`).
"""

from __future__ import annotations

import atexit
import gc
import os
import runpy
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

PLANNING_THRESHOLDS = (20_000, 20, 20)
"""``gc.set_threshold`` in a planning process: a young collection every 20,000 net allocations instead of 700,
a full one after 400 of them instead of 100 — the import of the stack above ran 45 collections (0.7 s), none full,
and the same plan came out byte for byte (docs/benchmarks.md, "Where a plan's seconds go")."""

DEFAULT_THRESHOLDS = (700, 10, 10)
"""CPython 3.11's ``gc.get_threshold()`` at start (``Modules/gcmodule.c``)."""

_registered = False


def no_collection_at_exit() -> None:
    """Freeze every object when the interpreter exits (an ``atexit`` handler: they all run before the final
    collection), so that its final full collection walks nothing. Idempotent."""
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True


def end_rank(code: int) -> NoReturn:
    """End a rank program now, with ``code``, its output flushed (call it once the report is written and the process
    group destroyed). ``os._exit`` skips the interpreter's finalization and the C++ static destructors that run after
    it, where a CPU rank now and then aborted after writing its report ("terminate called without an active
    exception": a ``std::thread`` destroyed while still joinable, SIGABRT) — seen in a study's FP32 reference and in
    the fresh-clone suite's tests/real/deepspeed/test_init_real.py, each turning a measured run into a crash. Nothing
    a rank program writes waits for the exit: its reports are written and renamed before; the ``atexit`` handlers
    skipped are the interpreter's own (and :func:`no_collection_at_exit`'s, which this makes moot). A user's script
    ends alike, through its hook (:func:`launchers.rank.script_hook._finish`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def for_planning() -> None:
    """A process that measures no real memory: :data:`PLANNING_THRESHOLDS`, and no collection at exit."""
    gc.set_threshold(*PLANNING_THRESHOLDS)
    no_collection_at_exit()


@contextmanager
def default_thresholds() -> Iterator[None]:
    """:data:`DEFAULT_THRESHOLDS` while the block runs (a trace in a planning process), the thresholds before
    restored after."""
    before = gc.get_threshold()
    gc.set_threshold(*DEFAULT_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def main(argv: list[str]) -> int:
    """``MODULE ARGS...``: run MODULE as ``python -m MODULE ARGS...`` does (``runpy``, ``sys.argv`` its own), with
    no collection at exit; a ``SystemExit`` it raises (torchrun's exit status) passes through."""
    if not argv:
        print("usage: python -m launchers.process.collector MODULE ARGS...", file=sys.stderr)
        return 2
    no_collection_at_exit()
    sys.argv = list(argv)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
