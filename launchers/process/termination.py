"""SIGTERM and SIGHUP end a dsopt process the way Ctrl-C does: the running trial recorded, its ranks taken down.

A batch system ends a job with SIGTERM — SLURM at the job's time limit and on ``scancel`` (then SIGKILL after
``KillWait``, 30 s by default), Kubernetes at a pod's deletion — and a closed terminal sends SIGHUP. Python's
default for both is to die at once: no ``finally`` runs. A ``dsopt worker`` so killed leaves its trial RUNNING in
the study's storage (a journal storage has no heartbeat to fail it later, :mod:`optimizer.search.storage`), and a
DeepSpeed op build it started leaves torch's JIT-build lock without the owner record that lets the next launch
remove it (:mod:`launchers.ops.build_locks`: the record is written once a second while a launch runs, and at the
moment its ranks are stopped).

:func:`end_on_termination` makes those signals raise :class:`Terminated`, a ``KeyboardInterrupt``: every path that
already handles Ctrl-C handles them too —

* Optuna's ``study.optimize`` catches ``KeyboardInterrupt``, records the running trial as FAIL and re-raises it
  (``optuna/study/_optimize.py`` ``_run_trial``: ``except (Exception, KeyboardInterrupt)``), so a resumed study
  launches its candidate again;
* :func:`launchers.trial.local.execute` records the build locks its ranks hold and stops them (its
  ``except BaseException``);
* the command exits with 128 + the signal's number (:func:`exit_status`: 143 for SIGTERM, 129 for SIGHUP; 130 for
  Ctrl-C), as a shell reports a process the signal killed.

A second signal while the first is being handled is not raised again (the cleanup runs to its end; SIGKILL still
ends it).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals that end a dsopt process as Ctrl-C does (module doc)."""
SIGINT_STATUS = 128 + int(signal.SIGINT)
"""130: the exit status of a process Ctrl-C ended."""


class Terminated(KeyboardInterrupt):
    """One of :data:`ENDING_SIGNALS` arrived: raised where the process was, handled as Ctrl-C is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        """The signal's number."""


def exit_status(interrupt: KeyboardInterrupt) -> int:
    """The process's exit status after ``interrupt``: 128 + the signal's number (module doc)."""
    return 128 + interrupt.signum if isinstance(interrupt, Terminated) else SIGINT_STATUS


def interrupt_name(interrupt: KeyboardInterrupt) -> str:
    """``interrupted`` (Ctrl-C) or ``terminated by SIGTERM`` — for the one line the command prints."""
    return f"terminated by {interrupt.args[0]}" if isinstance(interrupt, Terminated) else "interrupted"


def end_on_termination() -> None:
    """Make :data:`ENDING_SIGNALS` raise :class:`Terminated` in the main thread (module doc); a signal ignored
    where the process started (``nohup`` ignores SIGHUP) stays ignored. Only the main thread can set handlers:
    elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return
    ending = False

    def handler(signum: int, _frame: FrameType | None) -> None:
        nonlocal ending
        if ending:  # the first one's cleanup is running: let it finish
            return
        ending = True
        raise Terminated(signum)

    for sig in ENDING_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, handler)
