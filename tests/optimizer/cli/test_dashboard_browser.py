"""``dsopt dashboard`` as a person sees it: a finished small study served by the real optuna-dashboard, its pages
rendered by headless Chromium (Debian's package, installed by ``bash dev.sh services`` / ``.ci/services``), and
what the page shows checked in the rendered DOM: the Pareto front drawn with every front trial, and a launched
trial's label and files. The study page's screenshot is kept: in ``$DSOPT_CI_ARTIFACTS`` when set (``.ci/run``
sets ``ci-artifacts/``), else in the test's temporary folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from dashboard_study import dashboard, studied

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no chromium: `bash dev.sh services` installs Debian's"),
              pytest.mark.slow]

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=20000", "--window-size=1400,1000")
"""Headless on a closed network (no background connections), and 20 s of virtual time for the page's
scripts and API calls to settle before the DOM or the picture is taken."""


def _chromium(profile: Path, *args: str) -> str:
    proc = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_the_dashboard_page_shows_the_pareto_front_and_a_trials_files(tiny, tmp_path):
    pytest.importorskip("optuna_dashboard")
    study = studied(tiny, n_trials=8)
    front = study.best_trials
    assert front and all(t.values[0] > 0 for t in study.trials if t.values)
    launched = next(t for t in front if "reused_from" not in t.user_attrs)
    with dashboard(tiny.path) as base:
        (summary,) = json.loads(urllib.request.urlopen(f"{base}/api/studies", timeout=5).read())["study_summaries"]
        page = f"{base}/dashboard/studies/{summary['study_id']}"
        dom = _chromium(tmp_path / "profile", "--dump-dom", page)
        assert "Pareto Front" in dom
        assert "training memory per device (bytes)" in dom and "tokens/s" in dom  # the axes are named
        # plotly draws one SVG path of class "point" per marker: at least the front's trials
        assert len(re.findall(r'class="point"', dom)) >= len(front)
        trial_page = _chromium(tmp_path / "profile", "--dump-dom", f"{page}/trials?numbers={launched.number}")
        assert launched.user_attrs["label"] in trial_page
        for name in ("ds_config.json", "result.json", "log-tail.txt"):
            assert name in trial_page
        folder = Path(os.environ.get("DSOPT_CI_ARTIFACTS") or tmp_path)
        folder.mkdir(parents=True, exist_ok=True)
        shot = folder / "dashboard.png"
        shot.unlink(missing_ok=True)
        _chromium(tmp_path / "profile", f"--screenshot={shot}", page)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
