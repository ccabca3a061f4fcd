"""dsopt's hook in a user's training script (``trial.command``): this folder is first on the ranks' ``PYTHONPATH``,
so Python's ``site`` imports this module before the script runs (docs/trials.md, "Your own training script").

In every process of a script trial's launch it keeps py-cpuinfo's answer (:mod:`launchers.process.cpu_info`); in a
rank it installs :mod:`launchers.rank.script_hook`; anywhere else it does nothing.
Then it runs the ``sitecustomize`` this folder shadows, if the environment has one further down the path.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _next_sitecustomize() -> None:
    for entry in sys.path:
        path = os.path.join(entry or os.getcwd(), "sitecustomize.py")
        if os.path.abspath(os.path.dirname(path)) == _HERE or not os.path.isfile(path):
            continue
        spec = importlib.util.spec_from_file_location("_dsopt_shadowed_sitecustomize", path)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        return


if os.environ.get("DSOPT_HOOK_PLAN"):
    from launchers.process.cpu_info import install as keep_cpu_info
    from launchers.rank.script_checks import wanted

    keep_cpu_info()  # every process of the launch: DeepSpeed's op loads probe the CPU once per node

    if wanted(os.environ):
        from launchers.rank.script_hook import install

        install()
_next_sitecustomize()
