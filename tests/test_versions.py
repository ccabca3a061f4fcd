"""The installed-versions check (optimizer/deepspeed/versions.py) and the pins that follow from it (pyproject.toml)."""

from __future__ import annotations

import io
import tomllib

import pytest

from optimizer.deepspeed import versions
from optimizer.deepspeed.versions import LEDGER_DEEPSPEED_VERSION, deepspeed_mismatch, installed_versions, release


@pytest.mark.parametrize(
    ("text", "parts"),
    [("0.19.8", (0, 19, 8)), ("2.13.0+cpu", (2, 13)), ("2.13", (2, 13)), ("0.19.8+cu124", (0, 19, 8)),
     ("0.20.0rc1", (0, 20)), ("v1.2.3.post4", (1, 2, 3)), ("5", (5,))],
)
def test_release_is_the_release_segment(text, parts):
    assert release(text) == parts


def test_release_refuses_what_is_not_a_version():
    with pytest.raises(ValueError, match="not a version"):
        release("unknown")


def test_the_ledgers_deepspeed_gives_no_warning():
    assert deepspeed_mismatch(LEDGER_DEEPSPEED_VERSION) is None
    assert deepspeed_mismatch(LEDGER_DEEPSPEED_VERSION + "+cu124") is None  # a local build of the same release


@pytest.mark.parametrize("installed", ["0.19.7", "0.20.0", "0.16.9", "not-a-version"])
def test_another_deepspeed_is_one_line_naming_both(installed):
    message = deepspeed_mismatch(installed)
    assert message is not None and "\n" not in message
    assert installed in message and LEDGER_DEEPSPEED_VERSION in message and "warning" in message


def test_a_missing_deepspeed_is_said():
    message = deepspeed_mismatch(None)
    assert message is not None and "not installed" in message


def test_the_warning_is_printed_once_per_process(monkeypatch):
    monkeypatch.setattr(versions, "_WARNED", set())
    out = io.StringIO()
    for _ in range(3):
        message = versions.warn_deepspeed_mismatch(stream=out, version_of=lambda _: "0.20.0")
    assert out.getvalue() == message + "\n"
    assert versions.warn_deepspeed_mismatch(stream=out, version_of=lambda _: LEDGER_DEEPSPEED_VERSION) is None
    assert out.getvalue() == message + "\n"


def test_installed_versions_name_the_libraries_a_trial_depends_on():
    import deepspeed
    import torch

    from optimizer import __version__

    found = installed_versions()
    assert found["torch"] == torch.__version__ and found["deepspeed"] == deepspeed.__version__
    assert found["dsopt"] == __version__ and "transformers" in found


def test_every_ledger_source_cites_the_same_deepspeed():
    from optimizer.ledger import init_phase as init_ledger
    from optimizer.ledger import model_states

    assert model_states.DS == init_ledger.DS == f"DeepSpeed {LEDGER_DEEPSPEED_VERSION}"


def test_pyproject_requires_the_deepspeed_the_ledger_follows(repo_root):
    project = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]
    pins = dict(tuple(part.strip() for part in spec.split(">=")) for spec in project["dependencies"] if ">=" in spec)
    assert release(pins["deepspeed"]) == release(LEDGER_DEEPSPEED_VERSION)
    assert release(pins["torch"]) >= (2, 5)


def test_dsopt_ledger_warns_about_another_deepspeed_on_one_line(monkeypatch, capsys, seed_study_path):
    from optimizer.cli import main

    monkeypatch.setattr(versions, "_WARNED", set())
    monkeypatch.setattr(versions, "installed_version", lambda name: "0.20.1" if name == "deepspeed" else None)
    assert main(["ledger", str(seed_study_path)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "DeepSpeed 0.20.1" in line] == [versions.deepspeed_mismatch("0.20.1")]
