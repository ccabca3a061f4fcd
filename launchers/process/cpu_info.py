"""py-cpuinfo's answer kept once per node: DeepSpeed's op builders ask for it on every op load in every rank.

DeepSpeed 0.19.8 calls ``cpuinfo.get_cpu_info()`` in ``OpBuilder.cpu_arch`` and ``OpBuilder.simd_width``
(``ops/op_builder/builder.py:427-449, 483-510``) — both run by ``cxx_args`` whenever ``jit_load`` loads an op,
even one built long ago — and in ``DeepSpeedCPUAdam.__init__`` (``ops/adam/cpu_adam.py:75``). py-cpuinfo 9 answers
by starting a Python subprocess that probes the CPU (``get_cpu_info_json`` runs its own file with ``--json``):
~1.3 s each on a 2-core machine. A CPU rank pays two of them in a row at ``init_distributed`` (the shared-memory
comm op, ``deepspeed/comm/torch.py:47-53``) — 2.7 s of a 12 s trial launch — and a rank that offloads the
optimizer pays three more.

The answer is the machine's, so :func:`install` makes ``cpuinfo.get_cpu_info`` read it from
``<TORCH_EXTENSIONS_DIR>/dsopt-cpuinfo/<host>-<machine>-<boot id>-<py-cpuinfo version>.json`` — beside the ops it is
used to build, per virtual environment and node — and the first call on a node (after each boot) probes and writes
it. DeepSpeed then builds and loads the same op with the same flags: it reads ``arch`` and ``flags`` (and
``vendor_id_raw`` in CPU Adam), fixed for a machine. The entry's moving field (``hz_actual``, the clock now) is the
first probe's.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import platform
import socket
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from launchers.process.after_import import AfterImport

FOLDER = "dsopt-cpuinfo"
"""The entries' folder under ``TORCH_EXTENSIONS_DIR``."""
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
"""Linux: a new value at every boot (a node's CPU can change only across one)."""


def entry_path(root: Path, version: str) -> Path:
    """This node's entry under ``root`` (an extensions folder) for py-cpuinfo ``version``."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:  # not Linux: the host name alone
        boot = "noboot"
    return root / FOLDER / f"{socket.gethostname()}-{platform.machine()}-{boot}-{version}.json"


def kept(probe: Callable[[], dict[str, Any]], path: Path) -> Callable[[], dict[str, Any]]:
    """``probe`` answered from ``path``: read when there, else probed and written (atomically; a folder that
    cannot be written only costs the probe). Only an answer with ``arch`` and ``flags`` is kept: a probe that raises
    (DeepSpeed then falls back to ``lscpu``) or answers ``{}`` (py-cpuinfo's when its subprocess fails) is asked
    again next time. Every call gets its own copy."""
    memo: list[dict[str, Any]] = []

    def get_cpu_info() -> dict[str, Any]:
        if memo:
            return copy.deepcopy(memo[0])
        info = _read(path)
        if info is None:
            info = probe()
            if not _usable(info):
                return info
            _write(path, info)
        memo.append(info)
        return copy.deepcopy(info)

    get_cpu_info.__doc__ = probe.__doc__
    return get_cpu_info


def _usable(info: Any) -> bool:
    return isinstance(info, dict) and "arch" in info and "flags" in info


def _read(path: Path) -> dict[str, Any] | None:
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if _usable(info) else None


def _write(path: Path, info: dict[str, Any]) -> None:
    part: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, part = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(handle, "w") as out:
            out.write(json.dumps(info))
        os.replace(part, path)
    except OSError:
        if part is not None:
            with contextlib.suppress(OSError):
                os.unlink(part)


def _patch(module: ModuleType, root: Path) -> None:
    probe = getattr(module, "get_cpu_info", None)
    if callable(probe) and not getattr(probe, "_dsopt_kept", False):
        version = str(getattr(module, "CPUINFO_VERSION_STRING", "unknown"))
        answer = kept(probe, entry_path(root, version))
        answer._dsopt_kept = True  # type: ignore[attr-defined]
        module.get_cpu_info = answer  # type: ignore[attr-defined]  # ``from cpuinfo import get_cpu_info`` reads this


def install(environ: Mapping[str, str] = os.environ) -> None:
    """Keep py-cpuinfo's answer (module doc) in this process once ``cpuinfo`` is imported; nothing without
    ``TORCH_EXTENSIONS_DIR`` (every dsopt launch sets it: :func:`launchers.trial.local.build_launch_plan`)."""
    root = environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        return
    if "cpuinfo" in sys.modules:
        _patch(sys.modules["cpuinfo"], Path(root))
    else:
        sys.meta_path.insert(0, AfterImport("cpuinfo", lambda module: _patch(module, Path(root))))
