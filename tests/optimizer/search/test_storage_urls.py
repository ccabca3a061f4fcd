"""Storage URLs without a server (optimizer/search/storage.py): which scheme means what, the refusals and their
one-line messages, the URL handed to SQLAlchemy and Optuna for PostgreSQL, and password masking.

Where the expected values come from:
- the schemes and messages are the literals the module states (its docstring lists ``sqlite:///``,
  ``postgresql+psycopg://`` (``postgresql://`` read as the same) and ``journal:///``; a refusal names
  ``--storage`` as its source); the wrapped backend error is "cannot open the study storage: TYPE: first line";
- a password ends at the **last** ``@`` of the user information, may hold ``:``, ``/`` or ``@`` (``credentials``'s
  docstring), and an ``@`` in it is sent percent-encoded as ``%40`` (RFC 3986, section 2.1);
- Optuna's tables are ``studies``, ``trials`` and ``version_info`` (optuna/storages/_rdb/models.py, as the module's
  ``OPTUNA_TABLES`` says). No PostgreSQL server runs here: SQLAlchemy's real inspector reads an SQLite file built
  with the standard ``sqlite3`` in place of the server, and the URL the module asked for is recorded.
"""

from __future__ import annotations

import pytest
from storage_fixtures import NO_TABLES, FakeRDBStorage, install_fake_rdb, sqlite_with_tables

from optimizer.search.storage import (
    StorageKind,
    allows_parallel_workers,
    check_readable,
    check_storage_url,
    load_stored,
    open_storage,
    redact,
    storage_error,
    storage_kind,
)
from optimizer.study.cluster_settings import WorkerSettings
from optimizer.study.errors import UserError

UNSUPPORTED = ("unsupported storage URL; use sqlite:///FILE (one process), postgresql+psycopg://USER@HOST/DB or "
               "journal:///SHARED/FILE.log")
JOURNAL_PATH = "a journal URL needs an absolute path in an existing folder, e.g. journal:///shared/studies/NAME.log"


def _refusal(call) -> UserError:
    with pytest.raises(UserError) as caught:
        call()
    return caught.value


# --- storage_kind / allows_parallel_workers ---------------------------------------------------------------------


@pytest.mark.parametrize(("url", "kind"), [
    ("sqlite:///study.db", StorageKind.SQLITE), ("sqlite:////shared/study.db", StorageKind.SQLITE),
    ("postgresql://dsopt@db.example/dsopt", StorageKind.POSTGRESQL),
    ("postgresql+psycopg://dsopt:pw@db.example:5432/dsopt", StorageKind.POSTGRESQL),
    ("journal:///shared/study.log", StorageKind.JOURNAL)])
def test_each_accepted_scheme_names_its_kind(url, kind):
    assert storage_kind(url) is kind
    assert allows_parallel_workers(url) is (kind is not StorageKind.SQLITE)  # SQLite: one process only


@pytest.mark.parametrize(("url", "key"), [
    ("mysql://root:hunter2@db.example/dsopt", "mysql://root:***@db.example/dsopt"),  # the password masked
    ("postgres://dsopt@db.example/dsopt", "postgres://dsopt@db.example/dsopt"),  # not one of the three schemes
    ("sqlite+pysqlite:///study.db", "sqlite+pysqlite:///study.db"),
    ("study.db", "study.db"),  # no scheme at all
    ("", "")])
def test_any_other_url_is_refused_with_the_three_accepted_forms(url, key):
    error = _refusal(lambda: storage_kind(url))
    assert (error.source, error.key, error.why) == ("--storage", key, UNSUPPORTED)
    assert _refusal(lambda: allows_parallel_workers(url)).why == UNSUPPORTED


# --- check_storage_url ------------------------------------------------------------------------------------------


def test_a_journal_file_needs_an_absolute_path_in_an_existing_folder(tmp_path):
    assert check_storage_url(f"journal://{tmp_path}/study.log") is None
    assert check_storage_url(f"journal://{tmp_path}/study.log", parallel=True) is None  # shared: allowed
    for url in ("journal://study.log", f"journal://{tmp_path}/absent/study.log"):
        error = _refusal(lambda url=url: check_storage_url(url))
        assert (error.source, error.key, error.why) == ("--storage", url, JOURNAL_PATH)
    assert not (tmp_path / "absent").exists()


def test_sqlite_in_memory_and_a_relative_file_in_the_working_folder_are_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert check_storage_url("sqlite:///:memory:") is None
    assert check_storage_url("sqlite:///study.db") is None  # its folder is "." (exists)
    assert not (tmp_path / "study.db").exists()  # checked, never touched


# --- storage_error ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("message", ["", "   \n\t "])
def test_a_backend_error_without_words_leaves_the_complaint_empty(message):
    error = storage_error("sqlite:///study.db", RuntimeError(message))
    assert (error.source, error.key) == ("--storage", "sqlite:///study.db")
    assert error.why == "cannot open the study storage: RuntimeError: "


def test_only_the_first_line_of_the_complaint_is_kept_and_cut_to_300_characters():
    error = storage_error("journal:///shared/study.log", OSError("\n  disk I/O error\nsecond line"))
    assert error.why == "cannot open the study storage: OSError: disk I/O error"
    long = storage_error("journal:///shared/study.log", ValueError("z" * 400 + "\nmore"))
    assert long.why == "cannot open the study storage: ValueError: " + "z" * 300


# --- redact -----------------------------------------------------------------------------------------------------


def test_a_longer_password_is_masked_whole_where_a_shorter_one_is_part_of_it():
    # secrets: 'hunter2' (the url) and 'hunter22' (the URL in the text); the echoed 'hunter22' must not become
    # '***2', so the longer one is replaced first
    text = 'login as postgresql://bob:hunter22@db2/x failed: "hunter22"'
    assert redact(text, url="postgresql://ann:hunter2@db1/x") == 'login as postgresql://bob:***@db2/x failed: "***"'
    # the same with the shorter secret given as a URL inside the text
    two = "tried postgresql://ann:hunter2@db1/x then postgresql://bob:hunter22@db2/x: hunter22 hunter2"
    assert redact(two) == "tried postgresql://ann:***@db1/x then postgresql://bob:***@db2/x: *** ***"


def test_a_text_that_is_a_url_keeps_user_host_andsqlite_with_tables():
    assert redact("postgresql://u:my pass@host:5432/db") == "postgresql://u:***@host:5432/db"  # space in the password
    assert redact("postgresql://u:a:b/c@d@host/db") == "postgresql://u:***@host/db"  # ':', '/', '@' in it
    assert redact("sqlite:////tmp/study.db is locked") == "sqlite:////tmp/study.db is locked"  # no password


def test_a_text_that_starts_with_a_url_masks_the_password_in_the_rest_too():
    # a backend's first line may start with the URL and echo the password after it (found by a reviewer: the text
    # was taken for one URL, its password slot masked and the echo kept)
    echoed = "postgresql://ann:hunter2@db1/x refused: password hunter2 wrong"
    assert redact(echoed) == "postgresql://ann:***@db1/x refused: password *** wrong"
    given = redact(echoed, url="postgresql://ann:hunter2@db1/x")
    assert given == "postgresql://ann:***@db1/x refused: password *** wrong"
    # a URL without a password first, another with one later: each URL alone (not one user part up to the last @)
    assert redact("postgresql://ann@db1/x refused: password for postgresql://bob:pw@h/d") == (
        "postgresql://ann@db1/x refused: password for postgresql://bob:***@h/d")


def test_the_given_url_is_masked_where_it_stands_in_the_text():
    url = "postgresql://u:a b@h/db"
    assert redact(f"cannot connect to {url}: timeout", url=url) == "cannot connect to postgresql://u:***@h/db: timeout"
    assert redact("password a b was rejected", url=url) == "password *** was rejected"
    assert redact("nothing secret here", url="postgresql://u@h/db") == "nothing secret here"


# --- load_stored ------------------------------------------------------------------------------------------------


def test_a_study_never_run_is_told_to_run_first(tmp_path):
    default_path, study_path = tmp_path / "study.db", tmp_path / "cpu-tiny.yaml"
    error = _refusal(lambda: load_stored(name="s", default_path=default_path, storage=None, study_path=study_path))
    assert (error.source, error.key) == (str(study_path), "study")
    assert error.why == f"no study storage at {default_path}; run 'dsopt study run {study_path}' first"
    assert str(error) == f"{study_path}: study: {error.why}"
    assert sorted(tmp_path.iterdir()) == []  # nothing created


# --- PostgreSQL, read without a server --------------------------------------------------------------------------

PG_URL = "postgresql://dsopt:p@ss://w@db.example:5432/dsopt"  # user 'dsopt', password 'p@ss://w' (last '@' ends it)
PG_MASKED = "postgresql://dsopt:***@db.example:5432/dsopt"
PG_SENT = "postgresql+psycopg://dsopt:p%40ss://w@db.example:5432/dsopt"  # psycopg's scheme, '@' -> '%40'


@pytest.fixture
def server_file(tmp_path, monkeypatch):
    """SQLAlchemy's create_engine opening an SQLite file in place of the PostgreSQL server; the URL and pool
    asked for, and each dispose, recorded."""
    import sqlalchemy

    real_create_engine = sqlalchemy.create_engine
    asked: list[tuple[str, object]] = []
    disposed: list[str] = []
    db = tmp_path / "server.db"

    def create_engine(url: str, **kwargs: object):
        asked.append((url, kwargs.get("poolclass")))
        engine = real_create_engine(f"sqlite:///{db}")
        real_dispose = engine.dispose
        engine.dispose = lambda *a, **k: (disposed.append(url), real_dispose(*a, **k))[1]
        return engine

    monkeypatch.setattr(sqlalchemy, "create_engine", create_engine)
    return db, asked, disposed


def test_a_postgresql_database_with_optunas_tables_is_readable(server_file):
    from sqlalchemy.pool import NullPool

    db, asked, disposed = server_file
    sqlite_with_tables(db, ("studies", "trials", "version_info", "alembic_version"))
    assert check_readable(PG_URL) is None
    assert asked == [(PG_SENT, NullPool)]  # one connection, not pooled
    assert disposed == [PG_SENT]


@pytest.mark.parametrize("tables", [(), ("studies", "trials"), ("trials", "version_info")])
def test_a_postgresql_database_lacking_an_optuna_table_is_refused(server_file, tables):
    db, asked, disposed = server_file
    sqlite_with_tables(db, tables)
    error = _refusal(lambda: check_readable(PG_URL))
    assert (error.source, error.key, error.why) == ("--storage", PG_MASKED, NO_TABLES)
    assert [url for url, _ in asked] == disposed == [PG_SENT]


@pytest.fixture
def fake_rdb(monkeypatch):
    return install_fake_rdb(monkeypatch)


def test_a_password_holding_scheme_like_text_reaches_optuna_whole(fake_rdb):
    opened = open_storage(PG_URL, workers=WorkerSettings())
    assert isinstance(opened, FakeRDBStorage)
    assert [url for url, _ in FakeRDBStorage.made] == fake_rdb == [PG_SENT]
    url = "postgresql+psycopg://dsopt:a://b://c@db.example/dsopt"  # no '@' in the password: sent as written
    open_storage(url, workers=WorkerSettings())
    assert FakeRDBStorage.made[-1][0] == url


def test_a_backend_failure_on_opening_is_one_line_with_the_password_masked(fake_rdb):
    FakeRDBStorage.fail = RuntimeError(f'could not connect to "{PG_SENT}"\nis the server running?')
    error = _refusal(lambda: open_storage(PG_URL, workers=WorkerSettings()))
    assert (error.source, error.key) == ("--storage", PG_MASKED)
    assert error.why == ('cannot open the study storage: RuntimeError: could not connect to '
                         '"postgresql+psycopg://dsopt:***@db.example:5432/dsopt"')


def test_a_journal_storage_opens_on_its_file_and_a_relative_one_is_refused(tmp_path):
    from optuna.storages import JournalStorage

    assert isinstance(open_storage(f"journal://{tmp_path}/study.log", workers=WorkerSettings()), JournalStorage)
    error = _refusal(lambda: open_storage("journal://study.log", workers=WorkerSettings()))
    assert (error.key, error.why) == ("journal://study.log", JOURNAL_PATH)
