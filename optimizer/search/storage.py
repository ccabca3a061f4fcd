"""Optuna storages for one process or many: which URL means what, one-line errors, passwords never shown.

Three kinds of storage URL are accepted (Optuna's own storages; nothing home-made):

- ``sqlite:///path/study.db`` — Optuna ``RDBStorage`` on a SQLite file: **one process only** (SQLite's
  file locks are not safe across nodes or on network filesystems); ``dsopt worker`` and ``dsopt slurm``
  refuse it.
- ``postgresql+psycopg://user:password@host:port/db`` (``postgresql://`` is read as the same, psycopg 3) —
  ``RDBStorage`` with heartbeats: every running trial records one every ``workers.heartbeat_s``; a trial
  silent for ``workers.grace_s`` (its worker died) is failed by the next worker that starts a trial and put
  back in the queue by ``RetryHeartbeatStaleTrialCallback`` (``workers.max_retry`` times).
- ``journal:///path/study.log`` — Optuna ``JournalStorage`` on a ``JournalFileBackend`` (an append-only file
  with a lock; works on a shared filesystem). Optuna 5's journal storage has no heartbeat: a trial whose
  worker died stays RUNNING — use PostgreSQL where nodes may die.

A password in a URL is never printed or written: :func:`redact` masks it in every message; prefer
``DSOPT_STORAGE`` in the environment, ``~/.pgpass`` or ``PGPASSWORD`` over a password on the command line.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any

from optimizer.study.cluster_settings import WorkerSettings
from optimizer.study.errors import UserError


class StorageKind(StrEnum):
    """What a storage URL names."""

    SQLITE = "sqlite"
    POSTGRESQL = "postgresql"
    JOURNAL = "journal"


def storage_kind(url: str) -> StorageKind:
    """The kind of ``url``; UserError for anything else."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme == "sqlite":
        return StorageKind.SQLITE
    if scheme in ("postgresql", "postgresql+psycopg"):
        return StorageKind.POSTGRESQL
    if scheme == "journal":
        return StorageKind.JOURNAL
    raise UserError(source="--storage", key=redact(url), why="unsupported storage URL; use sqlite:///FILE (one "
                    "process), postgresql+psycopg://USER@HOST/DB or journal:///SHARED/FILE.log")


def allows_parallel_workers(url: str) -> bool:
    """Whether several processes may share ``url`` (not SQLite)."""
    return storage_kind(url) is not StorageKind.SQLITE


def check_storage_url(url: str, *, parallel: bool = False) -> None:
    """Refuse (exit 2) a storage URL that cannot be opened, before anything is built or written and without
    touching it: an unknown scheme, SQLite for several workers, a journal file that is not an absolute path in
    an existing folder, an SQLite file whose folder does not exist, PostgreSQL without psycopg. Whether a
    server answers is known only on opening (:func:`open_storage`)."""
    kind = storage_kind(url)
    if parallel:
        check_shared_storage(url)
    if kind is StorageKind.JOURNAL:
        path = Path(url.removeprefix("journal://"))
        if not path.is_absolute() or not path.parent.is_dir():
            raise UserError(source="--storage", key=url, why="a journal URL needs an absolute path in an existing "
                            "folder, e.g. journal:///shared/studies/NAME.log")
    elif kind is StorageKind.SQLITE:
        file = url.removeprefix("sqlite:///")
        if url.startswith("sqlite:///") and file and file != ":memory:" and not Path(file).parent.is_dir():
            raise UserError(source="--storage", key=url, why=f"the SQLite file's folder {Path(file).parent} does "
                            "not exist (opening would fail after the model was prepared)")
    else:
        _require_psycopg(url)


def check_shared_storage(url: str) -> None:
    """Refuse (exit 2) a storage several workers cannot share: SQLite."""
    if not allows_parallel_workers(url):
        raise UserError(source="--storage", key=redact(url), why="SQLite is single-process: several workers "
                        "need postgresql+psycopg://... or journal:///shared/file.log (one process: 'dsopt study run')")


def open_storage(url: str, *, workers: WorkerSettings) -> Any:
    """The Optuna storage object for ``url`` (PostgreSQL with heartbeats and retries of stale trials)."""
    import optuna
    from optuna.storages import JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
    from optuna.storages.journal import JournalFileBackend

    kind = storage_kind(url)
    try:
        if kind is StorageKind.SQLITE:
            return RDBStorage(url)
        check_storage_url(url)
        if kind is StorageKind.JOURNAL:
            return JournalStorage(JournalFileBackend(url.removeprefix("journal://")))
        rdb_url = "postgresql+psycopg://" + connection_url(url).split("://", 1)[1]
        with warnings.catch_warnings():  # the callback is marked experimental; stable in practice since 2.8
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            callback = RetryHeartbeatStaleTrialCallback(max_retry=workers.max_retry)
            with _schema_lock(rdb_url):
                return RDBStorage(rdb_url, heartbeat_interval=workers.heartbeat_s, grace_period=workers.grace_s,
                                  heartbeat_stale_trial_callback=callback, engine_kwargs={"pool_pre_ping": True})
    except UserError:
        raise
    except Exception as err:  # sqlalchemy / psycopg / journal errors differ by backend
        raise storage_error(url, err) from None


def _require_psycopg(url: str) -> None:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        raise UserError(source="--storage", key=redact(url), why="PostgreSQL needs psycopg 3: pip install "
                        "'dsopt[cluster]' (or 'psycopg[binary]')") from None


OPTUNA_TABLES = ("studies", "trials", "version_info")
"""Tables every Optuna RDB storage has (optuna/storages/_rdb/models.py); their absence means not a study
storage. Optuna's ``RDBStorage`` would create them on opening, so a reader looks first."""


def _holds_optuna_tables(url: str) -> bool:
    """Whether the database ``url`` names has Optuna's tables, looked at without writing: SQLite opened
    read-only by the standard library, PostgreSQL through SQLAlchemy's inspector."""
    try:
        if storage_kind(url) is StorageKind.SQLITE:
            import sqlite3

            path = Path(url.removeprefix("sqlite:///"))
            with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
                names = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        else:
            _require_psycopg(url)
            import sqlalchemy
            from sqlalchemy.pool import NullPool

            engine = sqlalchemy.create_engine("postgresql+psycopg://" + connection_url(url).split("://", 1)[1],
                                              poolclass=NullPool)
            try:
                names = set(sqlalchemy.inspect(engine).get_table_names())
            finally:
                engine.dispose()
    except UserError:
        raise
    except Exception as err:  # not a database, an unreachable server: the backend says which
        raise storage_error(url, err) from None
    return all(name in names for name in OPTUNA_TABLES)


SCHEMA_LOCK_KEY = 0x64736F7074
"""The PostgreSQL advisory-lock key (``'dsopt'`` in ASCII) held while Optuna creates or checks its tables."""


@contextlib.contextmanager
def _schema_lock(rdb_url: str) -> Iterator[None]:
    """Hold a session-level PostgreSQL advisory lock while Optuna's ``RDBStorage`` is constructed.

    ``RDBStorage.__init__`` runs SQLAlchemy's ``metadata.create_all`` (optuna/storages/_rdb/storage.py), which
    checks for each table and then creates the missing ones. Workers started together on a fresh database (a
    SLURM array, several ``dsopt worker`` by hand) race between the check and the ``CREATE TABLE``, and the
    loser fails with ``duplicate key value violates unique constraint "pg_type_typname_nsp_index"`` (PostgreSQL
    guards its catalogue with unique indexes, not with locks). Under this lock the first worker creates the
    tables and the others find them. ``pg_advisory_lock`` waits; the lock ends with the connection.
    """
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    engine = sqlalchemy.create_engine(rdb_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
            connection.commit()
            try:
                yield
            finally:
                connection.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), {"key": SCHEMA_LOCK_KEY})
                connection.commit()
    finally:
        engine.dispose()


def storage_error(storage: str, err: Exception) -> UserError:
    """One line naming the storage (password masked) and the backend's first line of complaint."""
    first = (str(err).strip().splitlines() or [""])[0]
    return UserError(source="--storage", key=redact(storage),
                     why=f"cannot open the study storage: {type(err).__name__}: {redact(first, url=storage)[:300]}")


URL_TOKEN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")
"""A URL inside a message: a scheme, ``://`` and everything up to the next white space."""


def credentials(url: str) -> tuple[str, str | None, str]:
    """``(scheme://user, password or None, @host...)`` of a URL, split by parsing: the user information ends
    at the **last** ``@`` (a password may hold ``@``, ``:`` or ``/``; host, port and database name do not hold
    ``@``), the user name at the first ``:`` of it. No ``@``: no user information (password None)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url, None, ""
    userinfo, host = rest.rsplit("@", 1)
    user, colon, password = userinfo.partition(":")
    return f"{scheme}://{user}", (password if colon else None), "@" + host


def connection_url(url: str) -> str:
    """``url`` as SQLAlchemy must read it: an ``@`` in the password percent-encoded (its URL pattern stops the
    password at the first ``@`` and would take the rest for the host); anything else as written."""
    head, password, host = credentials(url)
    return url if password is None else f"{head}:{password.replace('@', '%40')}{host}"


def redact(text: str, *, url: str | None = None) -> str:
    """``text`` with the password of every URL in it — and of ``url`` — replaced by ``***``, found by parsing
    (:func:`credentials`: whatever characters it holds). A URL keeps its user, host and database; outside URLs
    the password is masked wherever it stands (a backend may echo it)."""
    if url and credentials(url)[1] is not None:  # the URL as given, wherever it stands (even a password with a space)
        head, _, tail = credentials(url)
        text = text.replace(url, f"{head}:***{tail}")
    # The text is one URL (its password may even hold a space) when it starts with one, nothing after the last
    # ``@`` is white space and its user information holds no other URL; otherwise each URL in it is found alone.
    whole_head, whole_password, whole_tail = credentials(text)
    starts = (URL_TOKEN.match(text) is not None and not any(c.isspace() for c in whole_tail)
              and "://" not in whole_head.partition("://")[2] + (whole_password or ""))
    tokens = ([url] if url else []) + ([text] if starts else []) + URL_TOKEN.findall(text)
    secrets = {p for token in tokens if (p := credentials(token)[1])}
    secrets |= {p.replace("@", "%40") for p in secrets}

    def hidden(segment: str) -> str:
        for secret in sorted(secrets, key=len, reverse=True):
            segment = segment.replace(secret, "***")
        return segment

    def masked(one: str) -> str:
        head, password, tail = credentials(one)
        return hidden(one) if password is None else f"{head}:***{tail}"

    if starts:
        return masked(text)
    parts = URL_TOKEN.split(text)
    out = [hidden(parts[0])]
    for one, rest in zip(URL_TOKEN.findall(text), parts[1:], strict=True):
        out += [masked(one), hidden(rest)]
    return "".join(out)


def check_readable(storage: str) -> None:
    """UserError unless ``storage`` already holds an Optuna storage: opening one with Optuna creates what is
    missing (an SQLite file, a journal file, the tables of an RDB), so a command that only reads looks first."""
    kind = storage_kind(storage)
    if kind is StorageKind.SQLITE and not Path(storage.removeprefix("sqlite:///")).exists():
        raise UserError(source="--storage", key=storage, why="no such SQLite file (reading never creates one)")
    if kind is StorageKind.JOURNAL and not Path(storage.removeprefix("journal://")).exists():
        raise UserError(source="--storage", key=storage, why="no such journal file (reading never creates one)")
    if kind is not StorageKind.JOURNAL and not _holds_optuna_tables(storage):
        raise UserError(source="--storage", key=redact(storage), why="holds no Optuna study tables (an empty or "
                        "foreign database); reading never writes them")


def load_stored(*, name: str, default_path: Path, storage: str | None, study_path: Path,
                workers: WorkerSettings | None = None) -> tuple[Any, Any]:
    """The stored Optuna study and the storage it was opened on (for a server that serves it:
    optuna-dashboard), or a UserError; never creates a storage just to read it."""
    import optuna

    if storage is None:
        if not default_path.exists():
            raise UserError(source=str(study_path), key="study", why=f"no study storage at {default_path}; run "
                            f"'dsopt study run {study_path}' first")
        storage = f"sqlite:///{default_path.resolve()}"
    check_readable(storage)
    opened = open_storage(storage, workers=workers or WorkerSettings())
    try:
        return optuna.load_study(study_name=name, storage=opened), opened
    except KeyError:
        raise UserError(source="--storage", key=redact(storage), why=f"no study named {name!r} in it") from None
    except Exception as err:
        raise storage_error(storage, err) from None
