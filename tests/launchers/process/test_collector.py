"""The garbage collector in dsopt's own processes (launchers/process/collector.py): a module started through
``python -m launchers.process.collector`` (a trial's torchrun) keeps its arguments and exit status and skips the final
collection at exit; the ``dsopt`` entry point collects less often and skips it too. Each is checked against a
control that does collect at exit, so the checks can fail."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from launchers.process.collector import DEFAULT_THRESHOLDS, PLANNING_THRESHOLDS, default_thresholds

ROOT = Path(__file__).resolve().parents[3]
CYCLE = '''import gc, sys
from pathlib import Path
{setup}
gc.disable()  # the cycle below is left for the collection at exit
class Node:
    def __del__(self):
        self.write("collected at exit")
node = Node(); node.write = Path(sys.argv[1]).write_text; node.self = node; del node
print("args", sys.argv[1:], "thresholds", gc.get_threshold())
sys.exit(int(sys.argv[2]))
'''
"""A module whose only unreachable object is a reference cycle with a finalizer: the interpreter's final collection
runs it (writing ``argv[1]``); a frozen heap leaves it to the operating system."""


def _run(tmp_path: Path, *args: str, setup: str = "") -> subprocess.CompletedProcess[str]:
    (tmp_path / "cycle.py").write_text(CYCLE.format(setup=setup))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, check=False,
                          cwd=tmp_path, env=env)


def test_a_module_run_through_it_keeps_its_arguments_and_exit_status_and_is_not_collected_at_exit(tmp_path):
    control = _run(tmp_path, "-m", "cycle", str(tmp_path / "control.txt"), "0")
    assert control.returncode == 0 and (tmp_path / "control.txt").read_text() == "collected at exit"
    run = _run(tmp_path, "-m", "launchers.process.collector", "cycle", str(tmp_path / "run.txt"), "3", "--flag")
    assert run.returncode == 3, run.stderr
    assert f"args ['{tmp_path / 'run.txt'}', '3', '--flag']" in run.stdout, run.stdout
    assert not (tmp_path / "run.txt").exists()  # the default thresholds kept: it measures nothing, it only exits
    assert "thresholds (700, 10, 10)" in run.stdout, run.stdout


def test_without_a_module_it_is_a_usage_error(tmp_path):
    run = _run(tmp_path, "-m", "launchers.process.collector")
    assert run.returncode == 2 and "usage: python -m launchers.process.collector MODULE" in run.stderr, run.stderr


def test_the_dsopt_entry_point_plans_with_fewer_collections_and_none_at_exit(tmp_path):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["dsopt"] == "optimizer.cli:entry"
    entry = "from optimizer import cli; cli.main = lambda: 0; cli.entry()"
    run = _run(tmp_path, "-m", "cycle", str(tmp_path / "run.txt"), "0", setup=entry)
    assert f"thresholds {PLANNING_THRESHOLDS}" in run.stdout and not (tmp_path / "run.txt").exists(), run.stdout


def test_a_trace_in_a_planning_process_runs_under_the_default_thresholds():
    before = gc.get_threshold()
    gc.set_threshold(*PLANNING_THRESHOLDS)
    try:
        with default_thresholds():
            assert gc.get_threshold() == DEFAULT_THRESHOLDS
        assert gc.get_threshold() == PLANNING_THRESHOLDS
    finally:
        gc.set_threshold(*before)


ENDING = '''import atexit, sys
from pathlib import Path
from launchers.process.collector import end_rank
atexit.register(Path(sys.argv[1]).write_text, "atexit ran")
print("report written", end="")  # unflushed: end_rank flushes it
sys.stdout.write("")
{end}(int(sys.argv[2]))
'''
"""A rank program's last lines: an ``atexit`` handler stands for the interpreter's teardown."""


def test_a_rank_program_ends_with_its_status_and_output_but_no_teardown(tmp_path):
    for end, marker in (("sys.exit", "control.txt"), ("end_rank", "run.txt")):
        (tmp_path / f"{end}.py").write_text(ENDING.format(end=end))
        run = _run(tmp_path, str(tmp_path / f"{end}.py"), str(tmp_path / marker), "5")
        assert run.returncode == 5 and run.stdout == "report written", (run.stdout, run.stderr)
    assert (tmp_path / "control.txt").read_text() == "atexit ran"  # the control tears down
    assert not (tmp_path / "run.txt").exists()  # end_rank: no atexit handler, no finalization


def test_the_trial_and_probe_ranks_end_through_it():
    for module in ("trial_rank", "probe_rank", "peak_attribution"):
        text = (ROOT / "launchers" / "rank" / f"{module}.py").read_text()
        main_block = text[text.index('if __name__ == "__main__":'):]
        assert "end_rank(main(" in main_block, module
