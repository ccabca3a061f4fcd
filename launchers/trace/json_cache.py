"""A JSON store with one file per key, shared by any number of processes: the trace cache and the parameter
inventory (:mod:`launchers.trace.cache_dir`).

Each entry is ``FOLDER/<SHA-256 of its key>.json`` holding ``{"key": KEY, "entry": ...}``. It is written to a
temporary file of its own (``tempfile.mkstemp`` in the same folder) and renamed over the entry, so two workers
writing at once never lose each other's entries — each key is its own file — and a reader never sees half a
file. An entry that cannot be read or parsed, or whose stored key is not the key asked for, counts as missing
(it is made again and rewritten). A folder that cannot be written (a read-only home on compute nodes) costs a
warning once per process, not the command.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

_WARNED: set[str] = set()
"""Folders whose write failure was reported in this process."""


def key_digest(key: str) -> str:
    """The SHA-256 of ``key`` (UTF-8), in hex: the entry's file name."""
    return hashlib.sha256(key.encode()).hexdigest()


class KeyedJsonStore:
    """The entries under ``folder`` (module doc); each one read at most once per instance. Without a folder,
    entries live in this instance only."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._memo: dict[str, Any] = {}

    def path_for(self, key: str) -> Path | None:
        """The file that holds ``key``'s entry (None without a folder)."""
        return None if self.folder is None else self.folder / f"{key_digest(key)}.json"

    def get(self, key: str) -> Any | None:
        """``key``'s entry, or None when it is missing or unreadable."""
        if key in self._memo:
            return self._memo[key]
        path = self.path_for(key)
        if path is None:
            return None
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):  # absent, half-copied, or not JSON: missing
            return None
        if not isinstance(stored, dict) or stored.get("key") != key or "entry" not in stored:
            return None
        self._memo[key] = stored["entry"]
        return stored["entry"]

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def put(self, key: str, entry: Any) -> None:
        """Store ``entry`` under ``key``: atomically on disk when there is a folder (module doc)."""
        self._memo[key] = entry
        path = self.path_for(key)
        if path is None:
            return
        text = json.dumps({"key": key, "entry": entry}, separators=(",", ":")) + "\n"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem[:16]}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as out:
                    out.write(text)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as err:
            folder = str(path.parent)
            if folder not in _WARNED:
                _WARNED.add(folder)
                print(f"dsopt: warning: cannot write the cache folder {folder} ({err.strerror or err}); results "
                      "are kept for this run only (set DSOPT_CACHE_DIR to a writable folder)", file=sys.stderr)
