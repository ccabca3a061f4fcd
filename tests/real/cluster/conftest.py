"""Fixtures for the cluster tests: real PostgreSQL and a real one-node SLURM, started by ``.ci/services``.

The services' variables come from the environment or from the file ``.ci/services`` writes
(``$DSOPT_SERVICES_DIR/env``, default ``/tmp/dsopt-services/env``). A test that needs a service that is
not running skips and says which and how to start it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def _services_env() -> dict[str, str]:
    path = Path(os.environ.get("DSOPT_SERVICES_DIR", "/tmp/dsopt-services")) / "env"
    found = {}
    if path.exists():
        for line in path.read_text().splitlines():
            name, sep, value = line.partition("=")
            if sep:
                found[name.strip()] = value.strip()
    return found


def _setting(name: str) -> str | None:
    return os.environ.get(name) or _services_env().get(name)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    url = _setting("DSOPT_TEST_POSTGRES")
    if not url:
        pytest.skip("no PostgreSQL server: run 'bash dev.sh services' (root, Debian) or set DSOPT_TEST_POSTGRES")
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(url)
        with engine.connect():
            pass
        engine.dispose()
    except Exception as err:  # the server went away since the env file was written
        pytest.skip(f"PostgreSQL at DSOPT_TEST_POSTGRES is not reachable ({type(err).__name__}); "
                    "run 'bash dev.sh services'")
    return url


@pytest.fixture(scope="session")
def slurm_conf() -> str:
    conf = _setting("SLURM_CONF")
    if not conf or not Path(conf).exists() or shutil.which("sbatch") is None:
        pytest.skip("no SLURM cluster: run 'bash dev.sh services' (root, Debian: slurm-wlm + munge)")
    env = {**os.environ, "SLURM_CONF": conf}
    ping = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, check=False)
    if ping.returncode != 0 or not ping.stdout.strip():
        pytest.skip(f"SLURM is not answering (sinfo: {ping.stderr.strip()[:200]}); run 'bash dev.sh services'")
    return conf
