"""Workers opening a fresh PostgreSQL study storage at the same moment (a SLURM array starting): none may fail.

Optuna's ``RDBStorage`` creates its tables on first use; without :func:`optimizer.search.storage._schema_lock` the
processes race between SQLAlchemy's existence check and ``CREATE TABLE`` and the losers die with
``UniqueViolation: ... "pg_type_typname_nsp_index"`` (seen in CI on 2026-12-01 with three ``dsopt worker``).
"""

from __future__ import annotations

import multiprocessing
import uuid

import pytest

from optimizer.search.storage import open_storage
from optimizer.study.cluster_settings import WorkerSettings

pytestmark = pytest.mark.slow
PROCESSES = 6


def _open_after_barrier(url: str, barrier, results) -> None:
    barrier.wait()
    try:
        open_storage(url, workers=WorkerSettings()).get_all_studies()
        results.put("ok")
    except Exception as err:  # the test reports what each process met
        results.put(f"{type(err).__name__}: {err}")


@pytest.fixture
def fresh_database(postgres_url):
    import sqlalchemy

    name = f"dsopt_race_{uuid.uuid4().hex[:10]}"
    admin = sqlalchemy.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    base = postgres_url.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    with admin.connect() as connection:
        connection.execute(sqlalchemy.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.mark.parametrize("attempt", range(2))  # the race lost 2 of 3 times without the lock
def test_workers_opening_a_fresh_database_together_all_succeed(fresh_database, attempt):
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(PROCESSES), context.Queue()
    procs = [context.Process(target=_open_after_barrier, args=(fresh_database, barrier, results))
             for _ in range(PROCESSES)]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    assert outcomes == ["ok"] * PROCESSES, outcomes
