"""Start the ranks of one trial on this node: a pure launch plan, then one ``Popen`` in its own process group.

Build, then execute (accelerate's ``prepare_deepspeed_cmd_env`` → one ``Popen``): :func:`build_launch_plan`
is a pure function of its inputs and is snapshot-tested; :func:`execute` is the only place that starts
the process. Ranks are started by PyTorch's elastic launcher, ``python -m torch.distributed.run`` (torchrun):
on one node it needs no hostfile, pdsh or ssh, and when one rank fails it tears the others down. With no
GPU the ranks are CPU ranks: ``DS_ACCELERATOR=cpu`` (DeepSpeed's CPU accelerator, gloo collectives).
GPU ranks see only their worker's slice of the node (``CUDA_VISIBLE_DEVICES``, :mod:`launchers.trial.node_share`).

torchrun starts each rank in a session of its own, so a process group alone cannot reach them. Every
process of a launch therefore carries ``DSOPT_LAUNCH_ID`` in its environment; when the launch times out or
ends, :func:`execute` finds every process still carrying that id (``/proc/*/environ``) and stops it —
SIGTERM, a grace period, then SIGKILL — so no rank is ever left behind. While it runs, the JIT-build locks its
ranks hold are recorded (:mod:`launchers.ops.build_locks`), so that after a failure exactly the locks of its dead
ranks are removed — never a lock another node may be building under.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from launchers.ops.build_locks import clear_stale_build_locks, record_lock_owners  # the first also for old callers
from launchers.rank.script_vars import ACTIVE_VAR, OUT_VAR, PLAN_VAR

LOCK_POLL_S = 1.0
"""Seconds between looks for JIT-build locks held by the launch's ranks (an op build takes seconds to minutes)."""
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
    gpus: Sequence[str] | None = None,
    cpus_per_task: int | None = None,
    rank_command: Sequence[str] | None = None,
    rank_module: str = "launchers.rank.trial_rank",
) -> LaunchPlan:
    """The launch plan for ``ranks`` ranks per node running ``launchers.rank.trial_rank`` (pure).

    One node: torchrun with a static master on loopback. Several nodes (``nodes`` > 1, inside a SLURM
    allocation): ``srun`` starts one torchrun agent per node (``--ntasks-per-node=1``) and the agents meet
    through torchrun's c10d rendezvous at ``head_host:master_port`` (the worker's own node, first of the
    allocation), which assigns node ranks — no hostfile, pdsh or ssh. ``slurm_nodes`` (default ``nodes``) is
    how many SLURM nodes carry the agents; fewer than ``nodes`` packs several agents per node (used to test
    the multi-node path on one machine). With ``parent_pid`` the launcher runs under
    :mod:`launchers.process.orphan_guard`, so that it dies with the worker.

    ``cpu_count`` is the CPUs this worker may use (:func:`launchers.trial.node_share.read_cpu_allowance`, not the
    machine's count); each rank gets ``OMP_NUM_THREADS = cpu_count // ranks``. srun gets ``--cpus-per-task``
    (``cpus_per_task``, the study's ``slurm.cpus_per_task``, else ``cpu_count``) and the threads follow it:
    since SLURM 22.05 srun no longer inherits the allocation's ``--cpus-per-task`` — "srun will no longer read
    in SLURM_CPUS_PER_TASK" (RELEASE_NOTES for 22.05; sbatch(1), ``--cpus-per-task``: "must be requested
    again with the call to srun") — so without it each torchrun agent and all its ranks share one CPU.
    ``gpus`` (GPU ranks only) becomes ``CUDA_VISIBLE_DEVICES``: the worker's slice of the node
    (:func:`launchers.trial.node_share.gpu_slice`); None leaves the environment's. CPU ranks see no GPU.

    ``rank_command`` (a study's ``trial.command``, placeholders filled) replaces the built-in rank program: torchrun
    runs it as it is (``--no-python``), a leading ``python``/``python3`` becoming ``python`` (this environment's),
    and :mod:`launchers.rank.script_hook` measures it (``launchers/trial/script_site`` first on ``PYTHONPATH``, the
    plan and the output folder in :data:`~launchers.rank.script_vars.PLAN_VAR` /
    :data:`~launchers.rank.script_vars.OUT_VAR`). ``rank_module``: the built-in program each rank runs with the plan
    and the output folder (the probe's is :mod:`launchers.rank.probe_rank`).
    """
    trial_args: tuple[str, ...] = ("-m", rank_module, str(plan_path), str(out_dir))
    if rank_command is not None:
        head = python if Path(rank_command[0]).name in ("python", "python3") else rank_command[0]
        trial_args = ("--no-python", head, *rank_command[1:])
    node_cpus = cpu_count if nodes == 1 else (cpus_per_task or cpu_count)
    if nodes == 1:
        argv: tuple[str, ...] = (
            python, "-m", "launchers.process.collector", "torch.distributed.run",  # no full collection at its exit
            "--nnodes", "1", "--nproc_per_node", str(ranks),
            "--master_addr", "127.0.0.1", "--master_port", str(master_port), *trial_args,
        )
    else:
        hosts = slurm_nodes or nodes
        argv = (
            srun, f"--nodes={hosts}", f"--ntasks={nodes}", f"--ntasks-per-node={-(-nodes // hosts)}",
            f"--cpus-per-task={node_cpus}", "--kill-on-bad-exit=1", "--export=ALL",
            f"--job-name=dsopt-trial-{launch_id[:8]}",
            python, "-m", "launchers.process.collector", "torch.distributed.run",
            "--nnodes", str(nodes), "--nproc_per_node", str(ranks),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{head_host}:{master_port}", "--rdzv_id", launch_id,
            *trial_args,
        )
    if parent_pid is not None:
        argv = (python, "-m", "launchers.process.orphan_guard", str(parent_pid), *argv)
    env = dict(base_env)
    env["PYTHONUNBUFFERED"] = "1"
    site = [str(Path(__file__).resolve().parent / "script_site")] if rank_command is not None else []
    env["PYTHONPATH"] = os.pathsep.join([*site, *pythonpath, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    if rank_command is not None:
        env[PLAN_VAR], env[OUT_VAR] = str(plan_path), str(out_dir)
        for inherited in ("RANK", "LOCAL_RANK", "GROUP_RANK", ACTIVE_VAR):  # torchrun sets the ranks' own
            env.pop(inherited, None)
    env["OMP_NUM_THREADS"] = str(max(1, node_cpus // ranks))
    env["TORCHELASTIC_ERROR_FILE"] = str(out_dir / "elastic_error.json")
    env[LAUNCH_ID_VAR] = launch_id
    env["TORCH_EXTENSIONS_DIR"] = str(extensions_dir)
    # The accelerator is the study's decision, set both ways: an inherited DS_ACCELERATOR=cpu (a shell that ran a
    # CPU study) would otherwise turn a GPU study's ranks into CPU ranks (DeepSpeed's get_accelerator() reads it
    # first: accelerator/real_accelerator.py), and the rank decides CPU ranks from it too.
    env["DS_ACCELERATOR"] = "cpu" if cpu_ranks else "cuda"
    if cpu_ranks:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
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


def _wait_watching(proc: subprocess.Popen, *, deadline: float, watch: Callable[[], object]) -> int | None:
    """``proc``'s exit status, or None once ``deadline`` (monotonic s) passes; ``watch()`` every LOCK_POLL_S."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return proc.poll()
        try:
            return proc.wait(timeout=min(LOCK_POLL_S, left))
        except subprocess.TimeoutExpired:
            watch()


def execute(plan: LaunchPlan, *, timeout_s: float, log_path: Path) -> Execution:
    """Run the plan, logging to ``log_path``; stop it at ``timeout_s``; leave no process of it behind.

    Build locks: before the launch, those :func:`~launchers.ops.build_locks.clear_stale_build_locks` condemns are
    removed; during it, those its ranks hold are recorded; after a failure (every rank is gone by then) the
    recorded ones, now provably orphaned on this node, are removed — after an interruption too (Ctrl-C; SIGTERM or
    SIGHUP under ``dsopt``, :mod:`launchers.process.termination`), before it is raised on."""
    launch_id = plan.env[LAUNCH_ID_VAR]
    locks_root = Path(plan.env["TORCH_EXTENSIONS_DIR"])
    clear_stale_build_locks(locks_root)

    def watch() -> None:
        with contextlib.suppress(OSError):  # a record we cannot write only keeps a lock longer
            record_lock_owners(locks_root, pids=lambda: marked_processes(launch_id))

    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(plan.argv, env=plan.env, cwd=plan.cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode = _wait_watching(proc, deadline=start + timeout_s, watch=watch)
            timed_out = returncode is None
            if timed_out:
                watch()  # the locks held at the moment the ranks are stopped
                stop_launch(launch_id)
                proc.wait()
        except BaseException:  # KeyboardInterrupt (SIGINT; SIGTERM under dsopt) or any other exit: ranks go too
            watch()
            stop_launch(launch_id, grace_s=2.0)
            proc.wait()
            clear_stale_build_locks(locks_root)  # the locks its stopped ranks held: the next launch waits on none
            raise
    leftover = bool(marked_processes(launch_id))
    if leftover:
        stop_launch(launch_id, grace_s=1.0)
    if timed_out or returncode != 0:
        clear_stale_build_locks(locks_root)  # every rank of this launch is gone now: their recorded locks go
    return Execution(returncode=returncode, timed_out=timed_out, wall_s=time.monotonic() - start)


def log_tail(log_path: Path, *, limit: int = 4000) -> str:
    """The last ``limit`` characters of the log."""
    try:
        data = log_path.read_bytes()
    except FileNotFoundError:
        return ""
    return data[-limit:].decode("utf-8", errors="replace")
