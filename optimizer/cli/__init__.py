"""The ``dsopt`` command line, the top layer: one module per command (argument parsing and printing, one
library or launcher call); nothing below it imports it.

``main()`` returns the exit code: 0 on success, 2 on a user mistake (printed on one line); ``dsopt trial``
returns 1 when the trial ran and failed (its outcome — oom, oom_host, nan, unsupported, timeout, crash —
is printed). Run as the ``dsopt`` command (:func:`entry`), SIGTERM and SIGHUP end it as Ctrl-C does — the running
trial recorded as failed, its ranks stopped — with 128 + the signal's number (:mod:`launchers.process.termination`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from optimizer.cli import dashboard, demo, export, ledger, pareto, probe, slurm, study, trace, trial
from optimizer.cli.common import Parser
from optimizer.study.errors import EXIT_USER_ERROR, UserError

COMMANDS = (ledger, trial, study, slurm, export, pareto, dashboard, trace, probe, demo)
"""Each command module's ``register(sub)`` adds its parser (in ``dsopt --help`` order)."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dsopt", description="Search-based optimizer for DeepSpeed configurations.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except UserError as err:
        print(f"dsopt: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # `dsopt ledger --json | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return 0


def entry() -> int:
    """The ``dsopt`` console script and ``python -m optimizer.cli``: :func:`main` in a process of its own, whose
    garbage collector is set for planning (fewer collections, none at exit: :mod:`launchers.process.collector`) and
    which SIGTERM or SIGHUP ends as Ctrl-C does (:mod:`launchers.process.termination`): one line, no traceback."""
    from launchers.process.collector import for_planning
    from launchers.process.termination import end_on_termination, exit_status, interrupt_name

    for_planning()
    end_on_termination()
    try:
        return main()
    except KeyboardInterrupt as interrupt:  # a command that has no message of its own for it
        print(f"dsopt: {interrupt_name(interrupt)}", file=sys.stderr)
        return exit_status(interrupt)


if __name__ == "__main__":
    sys.exit(entry())
