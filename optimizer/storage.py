"""Optuna storage URLs: one-line errors, and passwords never printed or written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from optimizer.errors import UserError


def storage_error(storage: str, err: Exception) -> UserError:
    """One line naming the storage (password masked) and the backend's first line of complaint."""
    first = (str(err).strip().splitlines() or [""])[0]
    return UserError(source="--storage", key=redact(storage),
                     why=f"cannot open the study storage: {type(err).__name__}: {redact(first)[:300]}")


def redact(text: str) -> str:
    """Hide a password in a storage URL (``scheme://user:password@host``)."""
    return re.sub(r"(://[^:/@\s]+:)[^@\s]+@", r"\1***@", text)


def load_stored_study(*, name: str, default_path: Path, storage: str | None, study_path: Path) -> Any:
    """The stored Optuna study, or a UserError; never creates a storage just to read it."""
    import optuna

    if storage is None:
        if not default_path.exists():
            raise UserError(source=str(study_path), key="study", why=f"no study storage at {default_path}; run "
                            f"'dsopt study run {study_path}' first")
        storage = f"sqlite:///{default_path.resolve()}"
    elif storage.startswith("sqlite:///") and not Path(storage.removeprefix("sqlite:///")).exists():
        raise UserError(source="--storage", key=storage, why="no such SQLite file (reading never creates one)")
    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        raise UserError(source="--storage", key=redact(storage), why=f"no study named {name!r} in it") from None
    except Exception as err:
        raise storage_error(storage, err) from None
