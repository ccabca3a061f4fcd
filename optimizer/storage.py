"""Optuna storage URLs: one-line errors, and passwords never printed or written."""

from __future__ import annotations

import re

from optimizer.errors import UserError


def storage_error(storage: str, err: Exception) -> UserError:
    """One line naming the storage (password masked) and the backend's first line of complaint."""
    first = (str(err).strip().splitlines() or [""])[0]
    return UserError(source="--storage", key=redact(storage),
                     why=f"cannot open the study storage: {type(err).__name__}: {redact(first)[:300]}")


def redact(text: str) -> str:
    """Hide a password in a storage URL (``scheme://user:password@host``)."""
    return re.sub(r"(://[^:/@\s]+:)[^@\s]+@", r"\1***@", text)
