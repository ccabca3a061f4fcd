"""The rank processes of a test's own trials, for leak checks that other dsopt runs on the machine cannot fail.

Every process of a trial launch runs ``launchers.rank.trial_rank PLAN OUT`` (launchers/trial/local.py: the torchrun
agent carries the arguments it hands on, each rank runs ``python -m launchers.rank.trial_rank PLAN OUT``), and PLAN
and OUT
lie in the trial's folder, under the folder of the study the test wrote. A rank orphaned by a dead agent keeps
its command line, so it is still found; a process of another study — another test, a benchmark — is not.
"""

from __future__ import annotations

import os
from pathlib import Path

RANK_MODULE = "launchers.rank.trial_rank"


def _under(arg: str, roots: set[str]) -> bool:
    return any(arg == root or arg.startswith(root + os.sep) for root in roots)


def trial_processes(folder: Path) -> list[int]:
    """PIDs of live processes running ``launchers.rank.trial_rank`` on a plan or output path under ``folder``."""
    roots = {str(folder), str(Path(folder).resolve())}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if RANK_MODULE in args and any(_under(arg, roots) for arg in args):  # a zombie's cmdline is empty
            found.append(int(entry.name))
    return found
