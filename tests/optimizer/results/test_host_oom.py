"""Telling the kernel's OOM killer from a crash: the rule (optimizer/results/host_oom.py) and the launcher's readers
(launchers/trial/host_watch.py) on captured ``/proc`` and cgroup text."""

from __future__ import annotations

from pathlib import Path

import pytest

from launchers.trial.host_watch import HostWatch, MemoryCgroup, keyed_counts, meminfo_bytes, memory_cgroup
from optimizer.results.host_oom import NEAR_LIMIT_FRACTION, HostMemoryEvidence, host_oom_reason

GiB = 2**30


def _evidence(*, kills: int | None = 0, used: int | None = None, limit: int | None = 32 * GiB) -> HostMemoryEvidence:
    return HostMemoryEvidence(oom_kills=kills, oom_kills_source="memory.events", peak_used_bytes=used,
                              limit_bytes=limit, samples=10)


@pytest.mark.parametrize(
    ("returncode", "missing", "evidence", "oom_host"),
    [
        (-9, [0, 1], _evidence(used=31 * GiB), True),  # SIGKILL + memory near the limit
        (137, [1], _evidence(used=31 * GiB), True),  # the same through a shell (128 + 9)
        (-9, [0, 1], _evidence(used=8 * GiB), False),  # SIGKILL, memory far from the limit: a crash
        (-9, [0, 1], _evidence(kills=None), False),  # SIGKILL, nothing readable
        (-9, [0, 1], None, False),
        (1, [1], _evidence(kills=2, used=8 * GiB), True),  # torchrun's exit after a rank was OOM-killed
        (1, [1], _evidence(used=31 * GiB), False),  # near the limit, but no kill seen: not enough
        (-9, [], _evidence(kills=1, used=31 * GiB), False),  # every rank reported: nobody was killed
        (-15, [0], _evidence(used=31 * GiB), False),  # SIGTERM is not the OOM killer
    ],
)
def test_host_oom_needs_a_kill_and_memory_evidence(returncode, missing, evidence, oom_host):
    reason = host_oom_reason(returncode=returncode, missing_ranks=missing, evidence=evidence)
    assert (reason is not None) is oom_host
    if reason:
        assert f"ranks without a report: {missing}" in reason


def test_near_limit_is_a_share_of_the_limit():
    limit = 100 * GiB
    assert _evidence(used=int(NEAR_LIMIT_FRACTION * limit), limit=limit).near_limit
    assert not _evidence(used=int(NEAR_LIMIT_FRACTION * limit) - 1, limit=limit).near_limit
    assert not _evidence(used=None).near_limit and not _evidence(used=5, limit=None).near_limit


def test_the_message_states_the_numbers():
    reason = host_oom_reason(returncode=-9, missing_ranks=[0], evidence=_evidence(kills=1, used=31 * GiB))
    assert reason is not None
    assert "killed 1 process(es)" in reason and "31.00 of 32.00 GiB (97%" in reason and "exit code -9" in reason


def test_memory_cgroup_from_proc_self_cgroup():
    mount = Path("/sys/fs/cgroup")
    v2 = memory_cgroup("0::/user.slice/session-3.scope\n", mount=mount)
    assert v2 == MemoryCgroup(path=mount / "user.slice/session-3.scope", v2=True)
    assert memory_cgroup("0::/\n", mount=mount) == MemoryCgroup(path=mount, v2=True)  # a cgroup namespace's root
    hybrid = "9:name=systemd:/\n4:memory:/process_api/606d\n1:cpu,cpuacct:/\n0::/\n"
    assert memory_cgroup(hybrid, mount=mount) == MemoryCgroup(path=mount / "memory/process_api/606d", v2=False)
    assert memory_cgroup("", mount=mount) is None


def test_kernel_counters_and_meminfo_parse():
    events = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n"  # cgroup v2 memory.events
    assert keyed_counts(events)["oom_kill"] == 2
    v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"  # cgroup v1 memory.oom_control
    assert keyed_counts(v1)["oom_kill"] == 1
    assert keyed_counts("nr_free_pages 123\noom_kill 7\n")["oom_kill"] == 7  # /proc/vmstat
    info = meminfo_bytes("MemTotal:       24683584 kB\nMemFree:  100 kB\nMemAvailable:   24203608 kB\n"
                         "HugePages_Total:       0\n")
    assert info["MemTotal"] == 24683584 * 1024 and info["MemAvailable"] == 24203608 * 1024
    assert info["HugePages_Total"] == 0


def test_the_watch_reads_this_machine():
    with HostWatch(every_s=0.01) as watch:
        pass
    evidence = watch.evidence()
    assert evidence.samples >= 1
    if evidence.limit_bytes is not None:  # Linux: /proc/meminfo at least
        assert 0 < evidence.peak_used_bytes <= evidence.limit_bytes
    # Nothing was killed during the watch: where the kernel has a counter (/proc/vmstat's oom_kill since Linux 4.13,
    # or the cgroup's) the watch reads a difference of 0; with none at all it says it cannot tell (None).
    vmstat = Path("/proc/vmstat")
    counted = vmstat.exists() and "oom_kill" in keyed_counts(vmstat.read_text())
    assert evidence.oom_kills == 0 if counted else evidence.oom_kills in (None, 0)
    assert (evidence.oom_kills_source is not None) == (evidence.oom_kills is not None)
