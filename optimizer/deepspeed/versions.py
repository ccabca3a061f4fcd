"""The library versions a trial ran under, and the one DeepSpeed version the memory ledger follows.

The ledger (:mod:`optimizer.ledger.model_states`, :mod:`optimizer.ledger.init_phase`) is what DeepSpeed
:data:`LEDGER_DEEPSPEED_VERSION` allocates, line by line (every item cites a file:line of that release).
Another DeepSpeed still runs — trials measure whatever it does — but the pruning rule then judges candidates
by allocations that version may not make, so :func:`warn_deepspeed_mismatch` says so once, on one stderr line,
where trials are launched and in ``dsopt ledger``. It is a warning, not an error.

:func:`release` and :func:`deepspeed_mismatch` are pure; :func:`installed_versions` reads the installed
distributions' metadata (``importlib.metadata``: nothing is imported, so ``dsopt ledger`` stays torch-free).
The versions go into the FP32 reference's cache key and into every ``result.json``
(:mod:`launchers.trial.run`): a reference measured under another torch or DeepSpeed is not served.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from importlib import metadata
from typing import TextIO

from optimizer import __version__

LEDGER_DEEPSPEED_VERSION = "0.19.8"
"""The DeepSpeed release whose allocations the ledger follows (its file:line citations are to this release)."""
VERSIONED_DISTRIBUTIONS = ("torch", "deepspeed", "transformers")
"""Distributions whose version changes what a trial measures; ``transformers`` only where installed."""
_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def release(version: str) -> tuple[int, ...]:
    """The release segment of a version string (PEP 440), e.g. ``"0.19.8+cu124"`` → ``(0, 19, 8)``; trailing zeros
    dropped so that ``0.19`` equals ``0.19.0``. Pre-, post-, dev- and local parts are ignored: a ``+cu124`` or
    ``+cpu`` build of a release allocates what the release does. ValueError when there is none."""
    match = _RELEASE.match(version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    parts = [int(p) for p in match.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def deepspeed_mismatch(installed: str | None, *, expected: str = LEDGER_DEEPSPEED_VERSION) -> str | None:
    """One line saying that the installed DeepSpeed (None: not installed) is not the release the ledger
    follows, or None when it is."""
    follows = f"the memory ledger follows DeepSpeed {expected} line by line"
    if installed is None:
        return f"dsopt: warning: DeepSpeed is not installed; {follows} (pip install deepspeed=={expected})"
    try:
        same = release(installed) == release(expected)
    except ValueError:
        same = False
    if same:
        return None
    return (f"dsopt: warning: DeepSpeed {installed} is installed but {follows}; its predictions, and the pruning "
            f"that uses them, may not match what {installed} allocates (pip install deepspeed=={expected})")


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (None where it is not installed)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def installed_versions() -> dict[str, str | None]:
    """``{"torch": ..., "deepspeed": ..., "transformers": ..., "dsopt": ...}`` of this environment (None: not
    installed); dsopt's is the source tree's ``optimizer.__version__``."""
    return {**{name: installed_version(name) for name in VERSIONED_DISTRIBUTIONS}, "dsopt": __version__}


_WARNED: set[str] = set()
"""Messages printed so far in this process."""


def warn_deepspeed_mismatch(*, stream: TextIO | None = None,
                            version_of: Callable[[str], str | None] | None = None) -> str | None:
    """Print :func:`deepspeed_mismatch` of the installed DeepSpeed (``version_of("deepspeed")``, default
    :func:`installed_version`) on one stderr line, once per process and message; returns the message (None: the
    versions agree)."""
    message = deepspeed_mismatch((version_of or installed_version)("deepspeed"))
    if message is not None and message not in _WARNED:
        _WARNED.add(message)
        print(message, file=stream or sys.stderr, flush=True)
    return message
