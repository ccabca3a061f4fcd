"""Shared fixtures: the repository's study files."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def seed_study_path() -> Path:
    return ROOT / "studies" / "seed-1b-2x24gb.yaml"
