"""JIT-build locks left by killed ranks: the rule that removes only those whose owner is provably dead on this
node (launchers/ops/build_locks.py), and the records a launch keeps of the locks it holds."""

from __future__ import annotations

import pytest

from launchers.ops.build_locks import (
    FOREIGN_LOCK_S,
    LockOwner,
    NodeIdentity,
    ObservedLock,
    clear_stale_build_locks,
    lock_verdict,
    record_lock_owners,
    this_node,
)

HERE = NodeIdentity(host="node01", boot_id="boot-a", pid_ns="pid:[1]")


def _owner(**changes) -> LockOwner:
    base = {"host": "node01", "boot_id": "boot-a", "pid_ns": "pid:[1]", "pid": 4242, "start_ticks": 777,
            "lock_ino": 11, "lock_mtime_ns": 22}
    return LockOwner(**{**base, **changes})


def _lock(*, age_s: float = 5.0, busy: bool = False, owner: LockOwner | None = None,
          start_now: int | None = None) -> ObservedLock:
    return ObservedLock(age_s=age_s, ino=11, mtime_ns=22, busy_here=busy, owner=owner, owner_start_now=start_now)


@pytest.mark.parametrize(
    ("lock", "remove", "why"),
    [
        (_lock(busy=True, owner=_owner(), age_s=10 * FOREIGN_LOCK_S), False, "holds it or builds"),
        (_lock(owner=_owner(), start_now=None), True, "is dead on this node"),
        (_lock(owner=_owner(), start_now=999), True, "is dead on this node"),  # pid reused by another process
        (_lock(owner=_owner(), start_now=777), False, "is alive on this node"),
        (_lock(owner=_owner(boot_id="boot-0")), True, "rebooted"),
        (_lock(owner=_owner(host="node02")), False, "owner pid 4242 on node02: it may be in use elsewhere"),
        (_lock(owner=_owner(host="node02"), age_s=FOREIGN_LOCK_S + 1), True, "node02, and 3601 s old"),
        (_lock(owner=_owner(pid_ns="pid:[2]"), start_now=None), False, "may be in use elsewhere"),  # a container
        (_lock(owner=None, age_s=FOREIGN_LOCK_S - 1), False, "no recorded owner"),
        (_lock(owner=None, age_s=FOREIGN_LOCK_S + 1), True, "no recorded owner, and"),
        (_lock(owner=_owner(lock_ino=12), start_now=None), False, "no recorded owner"),  # record of an older lock
    ],
)
def test_build_lock_rule(lock, remove, why):
    verdict = lock_verdict(lock, node=HERE)
    assert verdict.remove is remove and why in verdict.why


# where torch puts an op's lock: <TORCH_EXTENSIONS_DIR>/<op>/lock when the variable is set (every dsopt launch sets
# it), <default root>/<py311_cpu>/<op>/lock when it is not (torch/utils/cpp_extension.py _get_build_directory)
LAYOUTS = pytest.mark.parametrize("layout", [".", "py311_cpu"], ids=["TORCH_EXTENSIONS_DIR", "default-root"])


@LAYOUTS
def test_build_locks_recorded_while_held_are_removed_once_their_owner_dies(tmp_path, layout):
    import os
    import subprocess
    import sys
    import time

    root = tmp_path / "ext"
    ours, foreign, unknown = (root / layout / op / "lock" for op in ("fused_adam", "cpu_adam", "cpu_lion"))
    for lock in (ours, foreign, unknown):
        lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | "
                               "os.O_EXCL); print('held', flush=True); time.sleep(60)", str(ours)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        foreign.touch()
        unknown.touch()
        stat = foreign.stat()
        (foreign.parent / "lock.owner").write_text(
            '{"host": "another-node", "boot_id": "b", "pid_ns": "p", "pid": 1, "start_ticks": 1, '
            f'"lock_ino": {stat.st_ino}, "lock_mtime_ns": {stat.st_mtime_ns}}}')
        assert record_lock_owners(root, pids=lambda: [holder.pid]) == 1
        assert record_lock_owners(root, pids=lambda: [holder.pid]) == 0  # already recorded
        assert clear_stale_build_locks(root) == []  # held open on this node
    finally:
        holder.kill()
        holder.wait()
    assert clear_stale_build_locks(root) == [ours]  # its owner is dead on this node
    assert not (ours.parent / "lock.owner").exists() and foreign.exists() and unknown.exists()
    old = time.time() - FOREIGN_LOCK_S - 60
    os.utime(unknown, (old, old))
    assert clear_stale_build_locks(root, node=this_node()) == [unknown]
    assert foreign.exists()  # another node's, young: it may be building right now


@LAYOUTS
def test_a_killed_launch_removes_its_ranks_lock_but_not_another_nodes(tmp_path, layout):
    """The launch's rank holds ``fused_adam/lock`` when the timeout kills it: recorded while held, removed after.
    ``cpu_adam/lock`` carries no record (another node may be building under it): it stays, as young as it is."""
    import os
    import sys
    import uuid

    from launchers.trial.local import LAUNCH_ID_VAR, LaunchPlan, execute

    root = tmp_path / "ext"
    ours, theirs = (root / layout / op / "lock" for op in ("fused_adam", "cpu_adam"))
    for lock in (ours, theirs):
        lock.parent.mkdir(parents=True)
    theirs.touch()
    rank = "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); time.sleep(60)"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), LAUNCH_ID_VAR: uuid.uuid4().hex}
    plan = LaunchPlan(argv=(sys.executable, "-c", rank, str(ours)), env=env, cwd=str(tmp_path))
    run = execute(plan, timeout_s=2.5, log_path=tmp_path / "log.txt")
    assert run.timed_out
    assert not ours.exists() and not (ours.parent / "lock.owner").exists()
    assert theirs.exists()
