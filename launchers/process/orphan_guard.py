"""``python -m launchers.process.orphan_guard PARENT_PID CMD...``: run CMD so that it dies with its parent.

Sets Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``, kept across ``exec``) and then
replaces itself with CMD. The launcher (torchrun) of a trial is started through it: if the worker that
started the trial is killed (SIGKILL, a node's OOM killer), torchrun receives SIGTERM and takes its ranks
down, instead of training on as an orphan while another worker retries the same candidate. The ranks
themselves set ``PR_SET_PDEATHSIG`` to SIGKILL (:func:`die_with_parent`), covering a torchrun that is
SIGKILLed. Elsewhere than Linux it only runs CMD.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
"""From <linux/prctl.h>."""


def die_with_parent(sig: int, *, parent_pid: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits; exit now if it already has."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(128 + int(sig))


def main(argv: list[str]) -> None:
    """``PARENT_PID CMD...``."""
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m launchers.process.orphan_guard PARENT_PID CMD...")
    die_with_parent(signal.SIGTERM, parent_pid=int(argv[0]))
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
