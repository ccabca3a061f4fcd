"""The leak check's own test (tests/real/deepspeed/trial_processes.py): it sees a leaked rank of its folder, only that.

No DeepSpeed: a sleeping Python process stands in for a rank, with a rank's command line.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from trial_processes import trial_processes


def _fake_rank(trial_dir: Path) -> subprocess.Popen:
    # python -c CODE ARGS...: ARGS stay on the command line as a rank's ``-m launchers.rank.trial_rank PLAN
    # OUT`` do
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "-m",
                             "launchers.rank.trial_rank", str(trial_dir / "plan.json"), str(trial_dir)])


def _started(proc: subprocess.Popen, folder: Path) -> None:
    """Wait until the process shows its own command line (under load /proc may still show the parent's for a
    moment after Popen returns)."""
    deadline = time.monotonic() + 20
    while proc.pid not in trial_processes(folder) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_leaked_rank_of_this_folder_is_found_and_no_other(tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "mine-not"  # a common prefix is not the same folder
    leaked = _fake_rank(mine / "trials" / "z0_fp32_ckpt=none_mbs=2")
    elsewhere = _fake_rank(other / "trials" / "z0_fp32_ckpt=none_mbs=2")
    try:
        _started(leaked, mine)
        _started(elsewhere, other)
        assert trial_processes(mine) == [leaked.pid]
        assert trial_processes(other) == [elsewhere.pid]
        assert trial_processes(tmp_path / "unrelated") == []
    finally:
        for proc in (leaked, elsewhere):
            proc.kill()
            proc.wait()
    assert trial_processes(mine) == [] and trial_processes(other) == []
