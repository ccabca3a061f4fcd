"""Start the ranks of one trial on this node: a pure launch plan, then one ``Popen`` in its own process group.

Build, then execute (accelerate's ``prepare_deepspeed_cmd_env`` → one ``Popen``): :func:`build_launch_plan`
is a pure function of its inputs and is snapshot-tested; :func:`execute` is the only place that starts
the process. Ranks are started by PyTorch's elastic launcher, ``python -m torch.distributed.run`` (torchrun):
on one node it needs no hostfile, pdsh or ssh, and when one rank fails it tears the others down. With no
GPU the ranks are CPU ranks: ``DS_ACCELERATOR=cpu`` (DeepSpeed's CPU accelerator, gloo collectives).

torchrun starts each rank in a session of its own, so a process group alone cannot reach them. Every
process of a launch therefore carries ``DSOPT_LAUNCH_ID`` in its environment; when the launch times out or
ends, :func:`execute` finds every process still carrying that id (``/proc/*/environ``) and stops it —
SIGTERM, a grace period, then SIGKILL — so no rank is ever left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

STALE_LOCK_S = 120.0
"""A JIT-build lock this old, with no compiler working in its folder, was left by a killed rank."""
TERM_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL when a launch is stopped."""
LAUNCH_ID_VAR = "DSOPT_LAUNCH_ID"
"""Environment variable every process of one launch inherits."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchPlan:
    """Everything needed to start the ranks: argv, environment, working directory."""

    argv: tuple[str, ...]
    """The launcher command line."""
    env: dict[str, str]
    """The complete environment of the launcher process."""
    cwd: str
    """Working directory."""


def build_launch_plan(
    *,
    python: str,
    ranks: int,
    cpu_ranks: bool,
    master_port: int,
    plan_path: Path,
    out_dir: Path,
    base_env: Mapping[str, str],
    pythonpath: Sequence[str],
    cwd: Path,
    cpu_count: int,
    launch_id: str,
    extensions_dir: Path,
    parent_pid: int | None = None,
    nodes: int = 1,
    head_host: str = "127.0.0.1",
    srun: str = "srun",
    slurm_nodes: int | None = None,
) -> LaunchPlan:
    """The launch plan for ``ranks`` ranks per node running ``launchers.trial_rank`` (pure).

    One node: torchrun with a static master on loopback. Several nodes (``nodes`` > 1, inside a SLURM
    allocation): ``srun`` starts one torchrun agent per node (``--ntasks-per-node=1``) and the agents meet
    through torchrun's c10d rendezvous at ``head_host:master_port`` (the worker's own node, first of the
    allocation), which assigns node ranks — no hostfile, pdsh or ssh. ``slurm_nodes`` (default ``nodes``) is
    how many SLURM nodes carry the agents; fewer than ``nodes`` packs several agents per node (used to test
    the multi-node path on one machine). With ``parent_pid`` the launcher runs under
    :mod:`launchers.orphan_guard`, so that it dies with the worker.
    """
    trial_args = ("-m", "launchers.trial_rank", str(plan_path), str(out_dir))
    if nodes == 1:
        argv: tuple[str, ...] = (
            python, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc_per_node", str(ranks),
            "--master_addr", "127.0.0.1", "--master_port", str(master_port), *trial_args,
        )
    else:
        hosts = slurm_nodes or nodes
        argv = (
            srun, f"--nodes={hosts}", f"--ntasks={nodes}", f"--ntasks-per-node={-(-nodes // hosts)}",
            "--kill-on-bad-exit=1", "--export=ALL", f"--job-name=dsopt-trial-{launch_id[:8]}",
            python, "-m", "torch.distributed.run",
            "--nnodes", str(nodes), "--nproc_per_node", str(ranks),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{head_host}:{master_port}", "--rdzv_id", launch_id,
            *trial_args,
        )
    if parent_pid is not None:
        argv = (python, "-m", "launchers.orphan_guard", str(parent_pid), *argv)
    env = dict(base_env)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env["OMP_NUM_THREADS"] = str(max(1, cpu_count // ranks))
    env["TORCHELASTIC_ERROR_FILE"] = str(out_dir / "elastic_error.json")
    env[LAUNCH_ID_VAR] = launch_id
    env["TORCH_EXTENSIONS_DIR"] = str(extensions_dir)
    if cpu_ranks:
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return LaunchPlan(argv=argv, env=env, cwd=str(cwd))


@dataclass(frozen=True, kw_only=True, slots=True)
class Execution:
    """How the launch ended."""

    returncode: int | None
    """The launcher's exit status (None when killed on timeout)."""
    timed_out: bool
    """Killed because it ran past the timeout."""
    wall_s: float
    """Wall time (s)."""


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def extensions_dir() -> Path:
    """Where DeepSpeed's JIT-compiled ops are cached for this environment: ``$TORCH_EXTENSIONS_DIR`` if set,
    else ``<sys.prefix>/torch_extensions`` — one cache per virtual environment, so two environments do not
    rebuild each other's ops (torch's default, ``~/.cache/torch_extensions``, is shared by all of them)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


def clear_stale_build_locks(root: Path, *, older_than_s: float = STALE_LOCK_S) -> list[Path]:
    """Remove JIT-build ``lock`` files left behind by killed ranks.

    torch's ``cpp_extension`` takes ``<op>/lock`` (a ``FileBaton``) on every load, even of a cached op, and
    every other process waits for it to disappear: a rank killed inside that window (a timeout, Ctrl-C, a
    crash) would hang every later trial. A lock older than ``older_than_s`` with no process working in its
    folder is removed.
    """
    removed = []
    if not root.is_dir():
        return removed
    busy = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                busy.add(Path(os.readlink(entry / "cwd")))
    now = time.time()
    for lock in root.glob("*/*/lock"):
        with contextlib.suppress(OSError):
            if now - lock.stat().st_mtime > older_than_s and not any(
                    folder == lock.parent or lock.parent in folder.parents for folder in busy):
                lock.unlink()
                removed.append(lock)
    return removed


def marked_processes(launch_id: str) -> list[int]:
    """PIDs of live processes whose environment carries ``DSOPT_LAUNCH_ID=launch_id`` (Linux ``/proc``)."""
    needle = f"{LAUNCH_ID_VAR}={launch_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def stop_launch(launch_id: str, *, grace_s: float = TERM_GRACE_S) -> int:
    """SIGTERM every process of the launch, SIGKILL what is left after ``grace_s``; returns how many."""
    pids = marked_processes(launch_id)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = marked_processes(launch_id)
        if not pids:
            break
    return len(pids)


def execute(plan: LaunchPlan, *, timeout_s: float, log_path: Path) -> Execution:
    """Run the plan, logging to ``log_path``; stop it at ``timeout_s``; leave no process of it behind."""
    launch_id = plan.env[LAUNCH_ID_VAR]
    locks_root = Path(plan.env["TORCH_EXTENSIONS_DIR"])
    clear_stale_build_locks(locks_root)
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(plan.argv, env=plan.env, cwd=plan.cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = False
        try:
            returncode: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_launch(launch_id)
            proc.wait()
            returncode = None
        except BaseException:  # KeyboardInterrupt (SIGINT) or any other exit: take the ranks down too
            stop_launch(launch_id, grace_s=2.0)
            proc.wait()
            raise
    leftover = bool(marked_processes(launch_id))
    if leftover:
        stop_launch(launch_id, grace_s=1.0)
    if timed_out or returncode != 0:
        clear_stale_build_locks(locks_root, older_than_s=0.0)  # every rank of this launch is gone now
    return Execution(returncode=returncode, timed_out=timed_out, wall_s=time.monotonic() - start)


def log_tail(log_path: Path, *, limit: int = 4000) -> str:
    """The last ``limit`` characters of the log."""
    try:
        data = log_path.read_bytes()
    except FileNotFoundError:
        return ""
    return data[-limit:].decode("utf-8", errors="replace")
