"""The measured steps' cyclic collections: the warm-up's heap settled, each later collection counted and timed."""

from __future__ import annotations

import gc

import pytest

from launchers.measure.gc_pauses import GcPauses, settle_heap


class _Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def thawed():
    """Whatever a test froze is thawed after it: the suite's other tests see CPython's usual generations."""
    yield
    gc.unfreeze()


def test_a_watch_counts_each_collection_by_generation_and_times_it():
    pauses = GcPauses()
    assert pauses.report() is None  # never started: no measured step
    pauses.start()
    pauses.start()  # idempotent: one callback
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(1)
    finally:
        pauses.stop()
    report = pauses.report()
    assert report["collections"] == [1, 1, 1]
    assert report["seconds"] > 0
    gc.collect(2)  # stopped: not counted
    assert pauses.report()["collections"] == [1, 1, 1]
    assert pauses._callback not in gc.callbacks


def test_settling_freezes_the_long_lived_heap_and_frees_its_garbage(thawed):
    kept = [[] for _ in range(50_000)]  # long-lived, tracked: a loaded library's objects
    for _ in range(1_000):
        _Node()  # cyclic garbage the warm-up left
    before = gc.get_freeze_count()
    settle_heap()
    assert gc.get_freeze_count() >= before + len(kept)
    assert not any(isinstance(o, _Node) for o in gc.get_objects())  # collected before the freeze
    # A full collection after the settle no longer walks the frozen heap: what generation 2 holds is small.
    assert len(gc.get_objects(generation=2)) < len(kept) // 10
    del kept

