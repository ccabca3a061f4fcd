"""Storage URLs without a server: refusals and their one-line messages, read-only checks of an SQLite file,
the PostgreSQL storage's settings, and password masking (optimizer/search/storage.py).

Where the expected values come from:
- the messages are the literals the module states for each refusal (source ``--storage``, the URL as key);
- Optuna's three tables (``studies``, ``trials``, ``version_info``) are those of optuna/storages/_rdb/models.py,
  as the module's ``OPTUNA_TABLES`` docstring says; the files here are built with the standard ``sqlite3``;
- ``'file is not a database'`` is SQLite's own message for a file without its header (sqlite3 ``DatabaseError``);
- the PostgreSQL settings are the module docstring's: heartbeat every ``workers.heartbeat_s``, a trial silent
  ``workers.grace_s`` is stale, retried ``workers.max_retry`` times, connections pinged before use, an ``@`` in the
  password percent-encoded as ``%40`` (RFC 3986, section 2.1) for SQLAlchemy.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
import warnings
from pathlib import Path

import pytest
from storage_fixtures import NO_TABLES, FakeRDBStorage, install_fake_rdb, sqlite_with_tables

from optimizer.search import storage as storage_module
from optimizer.search.storage import (
    check_readable,
    check_shared_storage,
    check_storage_url,
    connection_url,
    load_stored,
    open_storage,
    storage_error,
)
from optimizer.study.cluster_settings import WorkerSettings
from optimizer.study.errors import UserError


def _refused(call, url: str) -> UserError:
    """The one error ``call`` raises, checked to name the ``--storage`` URL."""
    with pytest.raises(UserError) as caught:
        call()
    assert (caught.value.source, caught.value.key) == ("--storage", url)
    return caught.value


def _tables(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


# --- check_readable ---------------------------------------------------------------------------------------------


def test_an_sqlite_file_with_optunas_tables_is_readable_and_left_as_it_was(tmp_path):
    db = sqlite_with_tables(tmp_path / "study.db", ("studies", "trials", "version_info"))
    assert check_readable(f"sqlite:///{db}") is None
    assert _tables(db) == {"studies", "trials", "version_info"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.db"]  # read-only: no journal, no new file


def test_an_existing_journal_file_is_readable(tmp_path):
    journal = tmp_path / "study.log"
    journal.write_text("")
    assert check_readable(f"journal://{journal}") is None


def test_a_missing_sqlite_file_is_refused_and_not_created(tmp_path):
    url = f"sqlite:///{tmp_path}/absent.db"
    error = _refused(lambda: check_readable(url), url)
    assert error.why == "no such SQLite file (reading never creates one)"
    assert str(error) == f"--storage: {url}: no such SQLite file (reading never creates one)"
    assert not (tmp_path / "absent.db").exists()


def test_a_missing_journal_file_is_refused(tmp_path):
    url = f"journal://{tmp_path}/absent.log"
    error = _refused(lambda: check_readable(url), url)
    assert error.why == "no such journal file (reading never creates one)"


@pytest.mark.parametrize("tables", [(), ("studies", "trials"), ("trials", "version_info", "other")])
def test_an_sqlite_file_lacking_one_optuna_table_is_refused_and_not_written(tmp_path, tables):
    db = sqlite_with_tables(tmp_path / "foreign.db", tables)
    url = f"sqlite:///{db}"
    assert _refused(lambda: check_readable(url), url).why == NO_TABLES
    assert _tables(db) == set(tables)


def test_a_file_that_is_not_a_database_names_sqlites_complaint(tmp_path):
    text = tmp_path / "notes.db"
    text.write_text("these are notes, not an SQLite database\n" * 4)
    url = f"sqlite:///{text}"
    error = _refused(lambda: check_readable(url), url)
    assert error.why == "cannot open the study storage: DatabaseError: file is not a database"


# --- check_storage_url / check_shared_storage / psycopg -------------------------------------------------------


def test_sqlite_is_refused_for_several_workers(tmp_path):
    url = f"sqlite:///{tmp_path}/study.db"
    for refuse in (lambda: check_shared_storage(url), lambda: check_storage_url(url, parallel=True)):
        assert _refused(refuse, url).why.startswith("SQLite is single-process: several workers need postgresql+psycopg://")
    assert check_shared_storage(f"journal://{tmp_path}/study.log") is None


def test_an_sqlite_file_in_a_missing_folder_is_refused_before_anything_is_built(tmp_path):
    url = f"sqlite:///{tmp_path}/no_such_folder/study.db"
    error = _refused(lambda: check_storage_url(url), url)
    assert error.why == (f"the SQLite file's folder {tmp_path}/no_such_folder does not exist (opening would "
                                "fail after the model was prepared)")
    assert check_storage_url(f"sqlite:///{tmp_path}/study.db") is None  # the folder exists: accepted
    assert check_storage_url("sqlite:///:memory:") is None


def test_postgresql_without_psycopg_says_what_to_install_and_masks_the_password(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # `import psycopg` now raises ImportError
    with pytest.raises(UserError) as caught:
        check_storage_url("postgresql+psycopg://dsopt:hunter2@db.example:5432/dsopt")
    assert caught.value.source == "--storage"
    assert caught.value.key == "postgresql+psycopg://dsopt:***@db.example:5432/dsopt"
    assert caught.value.why == ("PostgreSQL needs psycopg 3: pip install 'dsopt[cluster]' (or 'psycopg[binary]')")


# --- connection_url, storage_error / redact --------------------------------------------------------------------


@pytest.mark.parametrize("url", ["postgresql+psycopg://dsopt@db.example/dsopt", "sqlite:////shared/study.db",
                                 "journal:///shared/study.log"])
def test_a_url_without_a_password_is_used_as_written(url):
    assert connection_url(url) == url


def test_an_at_sign_in_the_password_is_percent_encoded():
    # user info ends at the last '@': user 'dsopt', password 'p@ss:w/rd@1'; each '@' -> '%40' (RFC 3986)
    url = "postgresql+psycopg://dsopt:p@ss:w/rd@1@db.example:5432/dsopt"
    assert connection_url(url) == "postgresql+psycopg://dsopt:p%40ss:w/rd%401@db.example:5432/dsopt"


def test_a_backend_echoing_the_percent_encoded_password_is_masked():
    url = "postgresql+psycopg://dsopt:p@ss@db.example/dsopt"  # password 'p@ss', as SQLAlchemy sends it: 'p%40ss'
    err = storage_error(url, RuntimeError('password "p%40ss" rejected\nsecond line'))
    assert err.source == "--storage"
    assert err.key == "postgresql+psycopg://dsopt:***@db.example/dsopt"
    assert err.why == 'cannot open the study storage: RuntimeError: password "***" rejected'


# --- load_stored --------------------------------------------------------------------------------------------------


def test_a_study_name_absent_from_the_storage_is_named(tmp_path, monkeypatch):
    import optuna

    db = sqlite_with_tables(tmp_path / "study.db", ("studies", "trials", "version_info"))
    opened: list[str] = []

    def open_in_memory(url: str, *, workers: WorkerSettings) -> optuna.storages.InMemoryStorage:
        opened.append(url)  # Optuna's RDBStorage on SQLite takes seconds to start: an empty storage stands in
        return optuna.storages.InMemoryStorage()

    monkeypatch.setattr(storage_module, "open_storage", open_in_memory)
    with pytest.raises(UserError) as caught:
        load_stored(name="absent", default_path=db, storage=None, study_path=tmp_path / "study.yaml")
    assert opened == [f"sqlite:///{db.resolve()}"]
    assert (caught.value.source, caught.value.key) == ("--storage", f"sqlite:///{db.resolve()}")
    assert caught.value.why == "no study named 'absent' in it"


# --- open_storage for PostgreSQL, without a server ---------------------------------------------------------------


@pytest.fixture
def fake_rdb(monkeypatch):
    locks = install_fake_rdb(monkeypatch)
    FakeRDBStorage.warn = True
    return locks


def test_postgresql_opens_with_the_worker_settings_under_the_schema_lock(fake_rdb):
    workers = WorkerSettings(heartbeat_s=7, grace_s=30, max_retry=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opened = open_storage("postgresql://dsopt:p@ss@db.example:5432/dsopt", workers=workers)
    rdb_url = "postgresql+psycopg://dsopt:p%40ss@db.example:5432/dsopt"  # scheme made psycopg's, '@' -> '%40'
    assert fake_rdb == [rdb_url]
    [(url, kwargs)] = FakeRDBStorage.made
    assert isinstance(opened, FakeRDBStorage)
    assert url == rdb_url
    assert kwargs["heartbeat_interval"] == 7
    assert kwargs["grace_period"] == 30
    assert kwargs["engine_kwargs"] == {"pool_pre_ping": True}
    assert kwargs["heartbeat_stale_trial_callback"]._max_retry == 3


def test_only_optunas_experimental_warning_is_silenced(fake_rdb):
    # RetryHeartbeatStaleTrialCallback warns ExperimentalWarning (silenced); the backend's UserWarning passes
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        open_storage("postgresql+psycopg://dsopt@db.example/dsopt", workers=WorkerSettings())
    assert [(w.category, str(w.message)) for w in seen] == [(UserWarning, "a warning from the backend")]
