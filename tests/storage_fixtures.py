"""What the storage tests share: SQLite files built by ``sqlite3`` (not by the code under test) and a stand-in for
Optuna's ``RDBStorage`` and dsopt's schema lock, so PostgreSQL paths run without a server."""

from __future__ import annotations

import contextlib
import sqlite3
import warnings
from pathlib import Path
from typing import ClassVar

import pytest

from optimizer.search import storage as storage_module

NO_TABLES = "holds no Optuna study tables (an empty or foreign database); reading never writes them"


def sqlite_with_tables(path: Path, tables: tuple[str, ...]) -> Path:
    """An SQLite file holding empty tables of these names."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        for table in tables:
            db.execute(f"CREATE TABLE {table} (id INTEGER)")
        db.commit()
    return path


class FakeRDBStorage:
    """Records what ``open_storage`` hands Optuna's RDBStorage (``made``: URL and keyword arguments); warns like a
    backend might when ``warn``, fails with ``fail`` when set."""

    made: ClassVar[list[tuple[str, dict]]] = []
    fail: ClassVar[Exception | None] = None
    warn: ClassVar[bool] = False

    def __init__(self, url: str, **kwargs: object) -> None:
        if FakeRDBStorage.warn:
            warnings.warn("a warning from the backend", UserWarning, stacklevel=1)
        FakeRDBStorage.made.append((url, kwargs))
        if FakeRDBStorage.fail is not None:
            raise FakeRDBStorage.fail


def install_fake_rdb(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """:class:`FakeRDBStorage` in place of Optuna's, reset; returns the URLs the schema lock was taken for."""
    import optuna.storages

    locks: list[str] = []

    @contextlib.contextmanager
    def lock(rdb_url: str):
        locks.append(rdb_url)
        yield

    FakeRDBStorage.made, FakeRDBStorage.fail, FakeRDBStorage.warn = [], None, False
    monkeypatch.setattr(optuna.storages, "RDBStorage", FakeRDBStorage)
    monkeypatch.setattr(storage_module, "_schema_lock", lock)
    return locks
