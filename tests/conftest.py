"""Shared fixtures: the repository's study files, and dsopt's cache folder in a temporary folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from optimizer.study.study_file import StudySpec, load_study

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def seed_study_path() -> Path:
    return ROOT / "studies" / "seed-1b-2x24gb.yaml"


@pytest.fixture
def tiny(tmp_path) -> StudySpec:
    """studies/cpu-tiny.yaml copied into the test's folder (its outputs land there), loaded."""
    shutil.copy(ROOT / "studies" / "cpu-tiny.yaml", tmp_path / "cpu-tiny.yaml")
    return load_study(tmp_path / "cpu-tiny.yaml")


@pytest.fixture(autouse=True, scope="session")
def dsopt_cache_dir(tmp_path_factory) -> Iterator[Path]:
    """dsopt's cache folder (traces, inventories: launchers/trace/cache_dir.py) in a temporary folder for the session,
    so tests never read or fill the user's ~/.cache and a fresh CI machine runs them the same; subprocesses
    inherit it. A test that needs a cold cache sets DSOPT_CACHE_DIR to its own tmp_path."""
    folder = tmp_path_factory.mktemp("dsopt-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DSOPT_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(autouse=True, scope="session")
def no_probe_by_default() -> Iterator[None]:
    """Studies in the suite do not probe the machine (``DSOPT_PROBE=off``, launchers/probe/machine.py): ~8 s per
    study shape that no test but the probe's own reads; those tests (tests/real/deepspeed/test_probe_real.py, the
    shared study of test_study.py) turn it back on. Subprocesses inherit it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DSOPT_PROBE", "off")
        yield


@pytest.fixture(autouse=True, scope="session")
def shared_extensions_dir() -> Iterator[Path]:
    """One cache of DeepSpeed's JIT-compiled ops for every process of the session: dsopt's launches use
    ``launchers.trial.local.extensions_dir()`` (one per virtual environment), while a script run without dsopt (the
    plain runs that check an export trains as measured) would build the same ops again under torch's default
    ``~/.cache/torch_extensions`` — minutes of compiling on 2 cores that test nothing. Subprocesses inherit it."""
    from launchers.trial.local import extensions_dir

    folder = extensions_dir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_EXTENSIONS_DIR", str(folder))
        yield folder


BACKGROUND_OPS = pytest.StashKey[subprocess.Popen]()
"""The session's background op build (:func:`pytest_collection_finish`)."""


def pytest_collection_finish(session: pytest.Session) -> None:
    """DeepSpeed's JIT-built ops — minutes of compiling on 2 cores in a fresh clone — built from the session's start
    in a background process at a low priority (``python tests/ops_study.py``: dsopt's own op preparation, under its
    node lock, in the session's ``TORCH_EXTENSIONS_DIR``), while the tests that need none run; only where the session
    runs a ``slow`` test. A study that needs them waits on the node lock (launchers/ops/build_locks.py); a test under
    tests/real/ waits for the process before any of its fixtures (:func:`pytest_runtest_setup`)."""
    if not any(item.get_closest_marker("slow") for item in session.items):
        return
    from launchers.trial.local import extensions_dir

    folder = Path(tempfile.mkdtemp(prefix="dsopt-suite-ops-"))
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "TORCH_EXTENSIONS_DIR": str(extensions_dir()),
           "DSOPT_CACHE_DIR": str(folder / "cache")}
    with (folder / "build.log").open("w") as log:
        session.config.stash[BACKGROUND_OPS] = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "ops_study.py"), str(folder)], cwd=ROOT, env=env, stdout=log,
            stderr=subprocess.STDOUT)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test under tests/real/ starts once the session's op build is over, its module's fixtures too (a trial run
    without a study's op preparation would otherwise build inside its timeout, or wait on torch's build lock)."""
    process = item.config.stash.get(BACKGROUND_OPS, None)
    if process is not None and item.path.is_relative_to(ROOT / "tests" / "real"):
        process.wait()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The background op build is never left running (an op's build lock must not outlive the session): waited for;
    its folder removed, or a failed one named with its log."""
    process = session.config.stash.get(BACKGROUND_OPS, None)
    if process is None:
        return
    try:
        process.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    folder = Path(process.args[-1])
    if process.returncode == 0:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"\nthe background op build ended with {process.returncode}: {folder / 'build.log'}")


@pytest.fixture(autouse=True)
def fresh_fake_tensor_cache() -> Iterator[None]:
    """Each test starts with torch's process-wide fake-tensor dispatch cache empty (``FakeTensorMode.cache``): the
    suite builds many models on fake tensors in one process, and a cache entry from one test's model served in
    another's was the likeliest path to the rare SIGSEGV seen inside ``_cached_dispatch_impl`` (docs/benchmarks.md,
    "The suite"). A dsopt process builds one study's models."""
    yield
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:
        return
    FakeTensorMode.cache_clear()
