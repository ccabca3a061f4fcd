"""dsopt's one cache folder: traces (``traces/``) and parameter inventories (``inventory/``) of every study.

Entries are keyed by content — the model as the ranks build it, the shapes, the library versions, the code that
takes them — never by a study's name or path, so a copied or moved study, or another study of the same model,
finds them. Many studies and workers (a SLURM array on a shared home) share the folder: each entry is its own
file, written atomically (:class:`launchers.trace.json_cache.KeyedJsonStore`).

The folder is ``$DSOPT_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/dsopt``, else ``~/.cache/dsopt`` (the XDG
user cache folder; on macOS too, as pip and Hugging Face do). Deleting it costs only the time to trace again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

CACHE_DIR_VAR = "DSOPT_CACHE_DIR"
"""Environment variable naming the cache folder (tests set it to a temporary folder)."""


def cache_dir() -> Path:
    """The cache folder (module doc); not created here — each store makes its subfolder when it first writes."""
    explicit = os.environ.get(CACHE_DIR_VAR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():  # the XDG spec: a relative value is invalid and ignored
        return Path(xdg) / "dsopt"
    return Path.home() / ".cache" / "dsopt"


def source_digest(modules: Sequence[str], *, folder: Path | None = None) -> str | None:
    """SHA-256 over the source files of ``modules`` (dotted names, found as ``import`` would find them, with
    ``folder`` first on the search path; none of them is imported, only a package above one), for a cache key
    of what that code computes: any edit makes new entries. None when one of them has no source file."""
    digest = hashlib.sha256()
    if folder is not None:
        sys.path.insert(0, str(folder))
    try:
        for name in modules:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                return None
            origin = getattr(spec, "origin", None)
            if not origin or not Path(origin).is_file():
                return None
            digest.update(name.encode() + b"\0" + Path(origin).read_bytes() + b"\0")
    finally:
        if folder is not None:
            sys.path.remove(str(folder))
    return digest.hexdigest()
