"""The installed-versions check (optimizer/deepspeed/versions.py) and the pins that follow from it (pyproject.toml)."""

from __future__ import annotations

import io
import tomllib

import pytest
from trial_fixtures import library_versions

from optimizer.deepspeed import versions
from optimizer.deepspeed.versions import LEDGER_DEEPSPEED_VERSION, deepspeed_mismatch, installed_versions, release

# The release the ledger's file:line citations are to (optimizer/ledger/model_states.py and init_phase.py docstrings:
# "DeepSpeed 0.19.8"), and the one line dsopt prints for another, written out.
CITED = "0.19.8"
ANOTHER_0_20_0 = ("dsopt: warning: DeepSpeed 0.20.0 is installed but the memory ledger follows DeepSpeed 0.19.8 "
                  "line by line; its predictions, and the pruning that uses them, may not match what 0.20.0 "
                  "allocates (pip install deepspeed==0.19.8)")


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
    assert LEDGER_DEEPSPEED_VERSION == CITED
    assert deepspeed_mismatch("0.19.8") is None
    assert deepspeed_mismatch("0.19.8+cu124") is None  # a local build of the same release
    assert deepspeed_mismatch("0.19.8.0") is None  # the same release segment, a trailing zero dropped
    assert deepspeed_mismatch("0.20.0", expected="0.20") is None  # another expected release, met


@pytest.mark.parametrize("installed", ["0.19.7", "0.20.0", "0.16.9", "0.19.80", "not-a-version"])
def test_another_deepspeed_is_one_line_naming_both(installed):
    message = deepspeed_mismatch(installed)
    assert message is not None and "\n" not in message
    assert message.startswith(f"dsopt: warning: DeepSpeed {installed} is installed but ")
    assert message.endswith("(pip install deepspeed==0.19.8)") and "follows DeepSpeed 0.19.8 line by line" in message


def test_the_warning_for_another_deepspeed_reads_in_full():
    assert deepspeed_mismatch("0.20.0") == ANOTHER_0_20_0


def test_a_missing_deepspeed_is_said():
    assert deepspeed_mismatch(None) == ("dsopt: warning: DeepSpeed is not installed; the memory ledger follows "
                                        "DeepSpeed 0.19.8 line by line (pip install deepspeed==0.19.8)")


def test_the_warning_is_printed_once_per_process(monkeypatch):
    monkeypatch.setattr(versions, "_WARNED", set())
    out = io.StringIO()
    returned = [versions.warn_deepspeed_mismatch(stream=out, version_of=lambda _: "0.20.0") for _ in range(3)]
    assert returned == [ANOTHER_0_20_0] * 3  # said each time it is asked, printed once
    assert out.getvalue() == ANOTHER_0_20_0 + "\n"
    assert versions.warn_deepspeed_mismatch(stream=out, version_of=lambda _: "0.19.8") is None
    assert out.getvalue() == ANOTHER_0_20_0 + "\n"


def test_installed_versions_name_the_libraries_a_trial_depends_on(repo_root):
    # each as the library reports it (__version__, not the metadata the code reads), dsopt's as pyproject declares it
    assert installed_versions() == library_versions(repo_root)


def test_every_ledger_source_cites_the_same_deepspeed():
    from optimizer.ledger import init_phase as init_ledger
    from optimizer.ledger import model_states

    assert model_states.DS == init_ledger.DS == "DeepSpeed 0.19.8"
    assert "DeepSpeed 0.19.8" in model_states.__doc__ and "DeepSpeed 0.19.8" in init_ledger.__doc__


def test_pyproject_requires_the_deepspeed_the_ledger_follows(repo_root):
    project = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]
    pins = dict(tuple(part.strip() for part in spec.split(">=")) for spec in project["dependencies"] if ">=" in spec)
    assert pins["deepspeed"] == CITED  # the ledger's release, as its lower bound
    assert pins["torch"] == "2.5"  # MemTracker (launchers/trace/tracer.py) was first released in torch 2.5


def test_dsopt_ledger_warns_about_another_deepspeed_on_one_line(monkeypatch, capsys, seed_study_path):
    from optimizer.cli import main

    monkeypatch.setattr(versions, "_WARNED", set())
    monkeypatch.setattr(versions, "installed_version", lambda name: "0.20.1" if name == "deepspeed" else None)
    assert main(["ledger", str(seed_study_path)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "DeepSpeed 0.20.1" in line] == [
        "dsopt: warning: DeepSpeed 0.20.1 is installed but the memory ledger follows DeepSpeed 0.19.8 line by line; "
        "its predictions, and the pruning that uses them, may not match what 0.20.1 allocates "
        "(pip install deepspeed==0.19.8)"]
