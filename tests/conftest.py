"""Shared fixtures: the repository's study files."""

from __future__ import annotations

import shutil
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
