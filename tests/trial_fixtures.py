"""What the trial tests share: a rank's report as trial_rank writes it, host-memory evidence of a launch, and the
library versions a trial runs under, found without dsopt's code."""

from __future__ import annotations

import tomllib
from pathlib import Path

from optimizer.results.host_oom import HostMemoryEvidence


def rank_report(rank, **extra):
    base = {"rank": rank, "status": "ok", "losses": [2.0, 1.5, 1.0], "grad_norms": [1.0, 1.0, 1.0],
            "step_times_s": [0.2, 0.4], "peak_allocated_bytes": 100 + rank, "peak_reserved_bytes": None,
            "peak_rss_bytes": 1000}
    base.update(extra)
    return base


GiB = 2**30
NEAR = HostMemoryEvidence(oom_kills=0, oom_kills_source="/proc/vmstat", peak_used_bytes=31 * GiB,
                          limit_bytes=32 * GiB, samples=40)
"""Host memory at 97 % of its limit, no OOM kill counted."""
FAR = HostMemoryEvidence(oom_kills=0, oom_kills_source="/proc/vmstat", peak_used_bytes=8 * GiB,
                         limit_bytes=32 * GiB, samples=40)
KILLED = HostMemoryEvidence(oom_kills=1, oom_kills_source="memory.events", peak_used_bytes=20 * GiB,
                            limit_bytes=32 * GiB, samples=40)
"""The kernel counted an OOM kill during the launch."""


def library_versions(repo_root: Path) -> dict[str, str | None]:
    """The versions a trial runs under, each as the library itself reports it (its ``__version__``, not the
    distribution metadata :func:`optimizer.deepspeed.versions.installed_versions` reads), dsopt's as pyproject.toml
    declares it; transformers None where it is not installed."""
    import deepspeed
    import torch

    try:
        import transformers
    except ImportError:
        transformers_version = None
    else:
        transformers_version = transformers.__version__
    declared = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["version"]
    return {"torch": str(torch.__version__), "deepspeed": deepspeed.__version__, "transformers": transformers_version,
            "dsopt": declared}
