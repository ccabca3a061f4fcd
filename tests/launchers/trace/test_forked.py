"""launchers/trace/forked.py: one function over many items, in this process and forked copies of it — results in
order, every item computed once where all goes well, and again here where a copy raised or died."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

import launchers.trace.forked as forked
from launchers.trace.forked import fork_safe, shared_map

pytestmark = pytest.mark.skipif(not fork_safe(), reason="forks only on Linux with one Python thread")


def _slow_pid(item: int) -> tuple[int, int]:
    time.sleep(0.3)  # long enough that the copy claims items too
    return item * item, os.getpid()


def _children() -> set[int]:
    """This process's children now (the suite's background op build may be one of them)."""
    return {child.pid for child in psutil.Process().children()}


def test_the_items_are_shared_between_this_process_and_a_copy_and_come_back_in_order(tmp_path):
    before = _children()
    parent = os.getpid()

    def waits_for_a_copy(item: int) -> tuple[int, int]:
        """In a copy: marks that it took an item. Here: after the item, waits (up to 20 s) until a copy took one,
        so that a busy machine that schedules the copy late does not leave every item to this process."""
        if os.getpid() != parent:
            (tmp_path / f"copy-took-{item}").touch()
            return item * item, os.getpid()
        deadline = time.monotonic() + 20
        while not any(tmp_path.glob("copy-took-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        return item * item, os.getpid()

    out = shared_map(waits_for_a_copy, list(range(6)), workers=2)
    assert [value for value, _ in out] == [i * i for i in range(6)]
    pids = {pid for _, pid in out}
    assert os.getpid() in pids and len(pids) == 2
    assert _children() <= before


def test_one_worker_or_one_item_stays_in_this_process():
    assert {pid for _, pid in shared_map(_slow_pid, [1, 2], workers=1)} == {os.getpid()}
    assert shared_map(_slow_pid, [3], workers=4) == [(9, os.getpid())]
    assert shared_map(_slow_pid, [], workers=4) == []


def test_tqdm_s_monitor_thread_is_stopped_so_that_copies_still_fork():
    tqdm = pytest.importorskip("tqdm")

    class Bar(tqdm.tqdm):  # a subclass keeps a monitor of its own, as transformers' bars do
        monitor_interval = 10  # tqdm's default (an earlier stop in this process set the base's to 0)
        monitor = None

    for bar_class in (tqdm.tqdm, Bar):
        bar_class.monitor_interval = 10
        for _ in bar_class(range(2), file=open(os.devnull, "w")):  # noqa: SIM115 — a bar starts the monitor
            time.sleep(0.01)
        assert bar_class.monitor is not None and bar_class.monitor.is_alive()
    assert fork_safe()  # stops them
    assert threading.active_count() == 1 and tqdm.tqdm.monitor is None and Bar.monitor is None
    for bar_class in (tqdm.tqdm, Bar):
        for _ in bar_class(range(2), file=open(os.devnull, "w")):  # noqa: SIM115 — and a later bar starts none
            pass
    assert threading.active_count() == 1


def test_with_another_thread_alive_nothing_forks():
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not fork_safe()
        assert {pid for _, pid in shared_map(_slow_pid, list(range(4)), workers=2)} == {os.getpid()}
    finally:
        stop.set()
        other.join()


def test_an_item_a_copy_failed_is_computed_here(tmp_path):
    before = _children()
    parent = os.getpid()

    def fails_in_copies(item: int) -> tuple[int, int]:
        time.sleep(0.3)
        if os.getpid() != parent:
            (tmp_path / f"copy-took-{item}").touch()
            raise RuntimeError("only in a copy")
        return item + 1, os.getpid()

    out = shared_map(fails_in_copies, list(range(4)), workers=2)
    assert out == [(i + 1, parent) for i in range(4)]
    assert list(tmp_path.glob("copy-took-*"))  # the copy did take an item, and this process did it again
    assert _children() <= before


def test_a_copy_that_dies_loses_nothing(tmp_path):
    before = _children()
    parent = os.getpid()

    def dies_in_copies(item: int) -> int:
        time.sleep(0.3)
        if os.getpid() != parent:
            (tmp_path / f"copy-took-{item}").touch()
            os._exit(9)
        return item * 10

    assert shared_map(dies_in_copies, list(range(4)), workers=2) == [0, 10, 20, 30]
    assert list(tmp_path.glob("copy-took-*"))
    assert _children() <= before


def test_a_stuck_copy_is_killed_past_the_deadline_and_its_items_computed_here(tmp_path, monkeypatch):
    monkeypatch.setattr(forked, "WAIT_FLOOR_S", 1.0)
    before = _children()
    parent = os.getpid()

    def stuck_in_copies(item: int) -> int:
        if os.getpid() != parent:
            (tmp_path / f"copy-took-{item}").touch()
            time.sleep(120)  # a lock held forever
        time.sleep(0.3)
        return item * 10

    start = time.monotonic()
    assert shared_map(stuck_in_copies, list(range(4)), workers=2) == [0, 10, 20, 30]
    assert time.monotonic() - start < 30 and list(tmp_path.glob("copy-took-*"))
    assert _children() <= before


def test_an_error_here_is_raised_and_no_copy_is_left_running():
    before = _children()
    parent = os.getpid()

    def fails_here(item: int) -> int:
        if os.getpid() == parent:
            raise ValueError(f"item {item}")
        time.sleep(30)  # a copy still busy when this process stops: killed, not waited for
        return item

    start = time.monotonic()
    with pytest.raises(ValueError, match="item"):
        shared_map(fails_here, list(range(4)), workers=2)
    assert time.monotonic() - start < 20
    assert _children() <= before
