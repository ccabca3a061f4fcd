"""A JSON dict in a study's output folder, read once and rewritten whole after each new entry.

Used by the trace cache (``studies/NAME/traces.json``) and the parameter inventory (``inventory.json``). Each
write goes through a temporary file named by the process id and a rename, so workers sharing the folder never
clash and a reader never sees half a file. An unreadable file counts as empty (its entries are made again).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class JsonFileCache:
    """``path``'s dict (empty when absent or unreadable); without a path nothing is stored."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {}
        if path is not None and path.exists():
            try:
                loaded = json.loads(path.read_text())
                self.data = loaded if isinstance(loaded, dict) else {}
            except ValueError:
                self.data = {}

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def store(self, key: str, entry: Any, *, indent: int | None = None) -> None:
        """Set ``key`` and rewrite the file (atomically)."""
        self.data[key] = entry
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")  # workers never share a tmp
        tmp.write_text(json.dumps(self.data, indent=indent) + "\n")
        tmp.replace(self.path)
