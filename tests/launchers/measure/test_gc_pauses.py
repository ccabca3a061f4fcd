"""The measured steps' cyclic collections: the warm-up's heap settled, each later collection counted and timed."""

from __future__ import annotations

import gc
import weakref

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


def test_settling_frees_the_warm_up_s_garbage_and_freezes_the_long_lived_heap(thawed):
    kept = [[] for _ in range(50_000)]  # long-lived, tracked: a loaded library's objects
    gc.disable()  # no collection but the settle's
    try:
        garbage = [weakref.ref(_Node()) for _ in range(1_000)]  # cyclic garbage the warm-up left
        assert all(ref() is not None for ref in garbage)
        before = gc.get_freeze_count()
        settle_heap()
    finally:
        gc.enable()
    assert all(ref() is None for ref in garbage)  # collected, not frozen with the rest
    assert gc.get_freeze_count() >= before + len(kept)
    # A full collection after the settle no longer walks the frozen heap: what generation 2 holds is small.
    assert len(gc.get_objects(generation=2)) < len(kept) // 10
    del kept


def test_finishing_thaws_the_heap_so_that_the_destroyed_engine_s_cycles_are_collected(thawed):
    pauses = GcPauses()
    engine = _Node()  # an engine held in a reference cycle (ZeRO-3's hooks hold theirs so)
    ref = weakref.ref(engine)
    pauses.settle_and_start()
    assert pauses.watching and gc.get_freeze_count() > 0
    del engine
    gc.collect()
    assert ref() is not None  # frozen: no collection sees it
    report = pauses.finish()
    assert not pauses.watching and gc.get_freeze_count() == 0
    assert report is not None and len(report["collections"]) == 3
    gc.collect()
    assert ref() is None


def test_a_watch_that_saw_no_collection_still_reports_its_zeros():
    pauses = GcPauses()
    pauses.start()
    report = pauses.finish()  # no collection ran between: counted, not "not recorded"
    assert report is not None and report["seconds"] >= 0
