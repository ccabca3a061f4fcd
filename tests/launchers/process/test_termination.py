"""SIGTERM and SIGHUP end a dsopt process as Ctrl-C does (launchers/process/termination.py): raised as a
KeyboardInterrupt where the process is, so a running launch takes its ranks and their build locks down, and the
process exits with 128 + the signal's number."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launchers.process.termination import SIGINT_STATUS, Terminated, exit_status, interrupt_name

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}

WAITER = """
import sys, time
from launchers.process.termination import end_on_termination, exit_status, interrupt_name
end_on_termination()
try:
    print("ready", flush=True)
    time.sleep(60)
except KeyboardInterrupt as interrupt:
    print("finally ran:", interrupt_name(interrupt), flush=True)
    time.sleep(float(sys.argv[1]))  # the cleanup: a second signal now must not cut it short
    sys.exit(exit_status(interrupt))
sys.exit(0)
"""


def _started(code: str, *args: str, **popen) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=ENV,
                            cwd=ROOT, **popen)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_exit_status_and_name_follow_the_signal():
    assert exit_status(Terminated(signal.SIGTERM)) == 143 and exit_status(Terminated(signal.SIGHUP)) == 129
    assert exit_status(KeyboardInterrupt()) == SIGINT_STATUS == 130
    assert interrupt_name(Terminated(signal.SIGTERM)) == "terminated by SIGTERM"
    assert interrupt_name(KeyboardInterrupt()) == "interrupted"
    assert isinstance(Terminated(signal.SIGTERM), KeyboardInterrupt)  # every Ctrl-C path (Optuna's too) takes it


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_the_signal_runs_the_cleanup_and_a_second_one_does_not_cut_it(sig, status):
    proc = _started(WAITER, "1.0")
    proc.send_signal(sig)
    time.sleep(0.3)
    proc.send_signal(sig)  # during the cleanup
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == status
    assert f"finally ran: terminated by {signal.Signals(sig).name}" in out


def test_a_signal_ignored_at_start_stays_ignored():
    """``nohup`` starts a process with SIGHUP ignored: it must keep running through one."""
    proc = _started(WAITER, "0", preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 143


LAUNCHER = """
import os, sys, uuid
from pathlib import Path
from launchers.process.termination import end_on_termination, exit_status
from launchers.trial.local import LAUNCH_ID_VAR, LaunchPlan, execute
end_on_termination()
root, lock = sys.argv[1], sys.argv[2]
rank = "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); time.sleep(60)"
env = {**os.environ, "TORCH_EXTENSIONS_DIR": root, LAUNCH_ID_VAR: uuid.uuid4().hex}
try:
    print("ready", flush=True)
    execute(LaunchPlan(argv=(sys.executable, "-c", rank, lock), env=env, cwd=root), timeout_s=60,
            log_path=Path(root) / "log.txt")
except KeyboardInterrupt as interrupt:
    sys.exit(exit_status(interrupt))
"""


def test_a_terminated_launch_leaves_no_rank_and_no_build_lock(tmp_path):
    """The rank takes torch's JIT-build lock (``<op>/lock``, created with O_EXCL as ``FileBaton`` does) and the
    launching process is sent SIGTERM at once — before the launch's once-a-second look has recorded the lock's
    owner. Killed outright, the process left that lock with no owner: every later op load waited on it for the
    hour a foreign lock is kept (launchers/ops/build_locks.py). Now it records the owner, stops the rank and
    removes the lock before it exits."""
    root = tmp_path / "ext"
    lock = root / "fused_adam" / "lock"
    lock.parent.mkdir(parents=True)
    proc = _started(LAUNCHER, str(root), str(lock))
    deadline = time.monotonic() + 30
    while not lock.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lock.exists(), "the rank never took the lock"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert not lock.exists()
    rank_alive = subprocess.run(["pgrep", "-f", str(lock)], capture_output=True, check=False).returncode == 0
    assert not rank_alive
