"""Telling the kernel's OOM killer from a crash: the facts of one launch and the rule that reads them (pure).

A rank the kernel's OOM killer picks gets SIGKILL (Linux ``mm/oom_kill.c``: the victim is always sent
SIGKILL). It cannot raise, so it writes no ``rank<r>.json``; torchrun reports ``exitcode: -9`` for it in the
log and itself exits 1 (``torch/distributed/elastic/multiprocessing/errors/__init__.py``: ``ChildFailedError``);
it writes no ``TORCHELASTIC_ERROR_FILE`` for a rank that died by a signal (``record`` dumps only a child's own
error file, and a SIGKILLed rank has none). The launch's exit status is SIGKILL itself — ``-9`` from
``Popen``, ``137`` from a shell — only when the launcher was the victim. So the launcher records what the
kernel says instead (:mod:`launchers.trial.host_watch`): its count of OOM kills over the launch — cgroup v2
``memory.events`` ``oom_kill`` of the launcher's cgroup (Linux ``Documentation/admin-guide/cgroup-v2.rst``;
the victim's cgroup counts every OOM kill, global or cgroup-limited) or, without one, the system-wide
``/proc/vmstat`` ``oom_kill`` (Linux ≥ 4.13) — and the host memory in use, sampled while the ranks ran.

The rule (:func:`host_oom_reason`): ranks ended without a report, and either the kernel counted an OOM kill
during the launch (that count is itself a SIGKILL: nothing else is needed), or the launch ended by SIGKILL
with host memory near its limit. A SIGKILL without memory evidence stays a crash (a person's ``kill -9``,
SLURM's ``--kill-on-bad-exit``), as does memory near the limit without a kill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SIGKILL_EXIT_CODES = (-9, 128 + 9)
"""The launch's exit status when it was SIGKILLed: ``Popen.returncode`` is −signal; a shell reports 128 + signal."""
NEAR_LIMIT_FRACTION = 0.9
"""Host memory in use ≥ this share of its limit is "near the limit". The sampler looks every
:data:`launchers.trial.host_watch.SAMPLE_EVERY_S` seconds, and the kernel kills as soon as memory runs out, so the
last sample before a kill can sit a few percent below 100 %; 90 % leaves that room without calling an
ordinary busy machine (page cache excluded, see :class:`HostMemoryEvidence`) full."""
GIB = 2**30


@dataclass(frozen=True, kw_only=True, slots=True)
class HostMemoryEvidence:
    """What the launcher saw of host memory while one launch ran (None: could not be read here)."""

    oom_kills: int | None
    """Processes the kernel's OOM killer killed during the launch (the counter's increase)."""
    oom_kills_source: str = ""
    """Where the count comes from: the cgroup's ``memory.events`` path or ``/proc/vmstat``."""
    peak_used_bytes: int | None = None
    """The highest host memory in use seen (of the view closest to its limit): ``MemTotal − MemAvailable``
    (``/proc/meminfo``), or the cgroup's ``memory.current − inactive_file`` (kubelet's working set)."""
    limit_bytes: int | None = None
    """The limit of that view: ``MemTotal``, or the cgroup's ``memory.max``."""
    samples: int = 0
    """How many samples were taken."""

    @property
    def used_fraction(self) -> float | None:
        """``peak_used_bytes / limit_bytes`` (None without both)."""
        if self.peak_used_bytes is None or not self.limit_bytes:
            return None
        return self.peak_used_bytes / self.limit_bytes

    @property
    def near_limit(self) -> bool:
        """Host memory in use reached :data:`NEAR_LIMIT_FRACTION` of its limit."""
        fraction = self.used_fraction
        return fraction is not None and fraction >= NEAR_LIMIT_FRACTION


def host_oom_reason(*, returncode: int | None, missing_ranks: Sequence[int],
                    evidence: HostMemoryEvidence | None) -> str | None:
    """Why the launch ended by the kernel's OOM killer (the message of an ``oom_host`` outcome), or None when the
    facts do not say so (module doc). ``missing_ranks``: ranks that wrote no report."""
    if not missing_ranks or evidence is None:
        return None
    killed = bool(evidence.oom_kills)
    sigkill = returncode in SIGKILL_EXIT_CODES
    if not (killed or (sigkill and evidence.near_limit)):
        return None
    parts = [f"ranks without a report: {list(missing_ranks)}"]
    if killed:
        parts.append(f"the kernel's OOM killer killed {evidence.oom_kills} process(es) during the launch "
                     f"({evidence.oom_kills_source})")
    if sigkill:
        parts.append(f"the launcher ended by SIGKILL (exit code {returncode})")
    if evidence.used_fraction is not None:
        assert evidence.peak_used_bytes is not None and evidence.limit_bytes is not None
        parts.append(f"host memory in use peaked at {evidence.peak_used_bytes / GIB:.2f} of "
                     f"{evidence.limit_bytes / GIB:.2f} GiB ({evidence.used_fraction:.0%}; GiB = 2^30 bytes)")
    return "host memory exhausted: " + "; ".join(parts)
