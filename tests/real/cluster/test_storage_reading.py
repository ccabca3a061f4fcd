"""Reading a PostgreSQL storage never writes it, and a password is never shown, whatever it holds (real
PostgreSQL, ``bash dev.sh services``; the SQLite half is in tests/optimizer/cli/test_cli.py)."""

from __future__ import annotations

import pytest

from optimizer.cli import main
from tests.real.cluster.conftest import _setting

STUDY = "studies/cpu-tiny.yaml"


def _tables(url: str) -> set[str]:
    import sqlalchemy

    from optimizer.search.storage import connection_url

    engine = sqlalchemy.create_engine(connection_url(url))
    try:
        return set(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def odd_url() -> str:
    url = _setting("DSOPT_TEST_POSTGRES_ODD")
    if not url:
        pytest.skip("no PostgreSQL role with an '@' in its password: run 'bash dev.sh services'")
    try:
        _tables(url)
    except Exception as err:  # the server went away since the env file was written
        pytest.skip(f"PostgreSQL at DSOPT_TEST_POSTGRES_ODD is not reachable ({type(err).__name__}); "
                    "run 'bash dev.sh services'")
    return url


def test_an_empty_postgresql_database_is_read_not_written_and_the_odd_password_connects(odd_url, repo_root,
                                                                                      capsys, monkeypatch):
    monkeypatch.chdir(repo_root)
    assert _tables(odd_url) == set()  # connect with the password as typed: 'p@ss:w/rd@1'
    for command in (["pareto", STUDY], ["export", STUDY]):
        assert main([*command, "--storage", odd_url]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "holds no Optuna study tables" in err
        assert "ss:w" not in err and "rd@1" not in err and "p@ss" not in err  # no piece of the password
    assert _tables(odd_url) == set()  # reading created nothing
