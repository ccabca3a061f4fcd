"""``python -m launchers.ops.op_load OUT.json BUILDER...``: build or load DeepSpeed ops as a trial's ranks would.

Started by :func:`launchers.study.op_prep.build_ops` with the environment the ranks get (``TORCH_EXTENSIONS_DIR``,
``DS_ACCELERATOR``, ``CUDA_VISIBLE_DEVICES``), so that what it builds is what they load from the cache. For each
builder class name, with DeepSpeed's own builders (``deepspeed/ops/op_builder/builder.py``):
``get_accelerator().create_op_builder(name)``, then ``is_compatible()``, then ``load()`` — which loads a
pre-installed op, or JIT-builds it under torch's ``cpp_extension.load`` (cached: a later load only checks). The
report, rewritten after every op (so a build stopped at its timeout keeps those done), maps the builder's name to:

* ``status``: ``ready``; ``skipped`` (an optional op that DeepSpeed's ``is_compatible()`` rejects or this
  accelerator has no builder for: DeepSpeed does without it); ``missing`` (needed, and cannot be built or loaded);
* ``why``: the reason, for ``missing`` and ``skipped``;
* ``load_s``: seconds the ``load()`` took (a build, or a cache check).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launchers.process.collector import for_planning
from launchers.process.cpu_info import install as keep_cpu_info
from optimizer.study.errors import error_summary


def load_op(builder_name: str, *, optional: bool, create: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Build or load one op (module doc); never raises. ``create``: the builder factory (default: DeepSpeed's
    ``get_accelerator().create_op_builder``)."""
    if create is None:
        from deepspeed.accelerator import get_accelerator

        create = get_accelerator().create_op_builder
    builder = create(builder_name)
    if builder is None:
        return {"status": "skipped" if optional else "missing", "why": f"this accelerator has no {builder_name}",
                "load_s": 0.0}
    warnings = _collect_warnings(builder)
    try:
        compatible = bool(builder.is_compatible(verbose=True))
    except Exception as err:  # DeepSpeed's own probe treats a failing check as "not compatible"
        compatible = False
        warnings.append(error_summary(err))
    if not compatible:
        why = "DeepSpeed's is_compatible() says no" + (f" ({'; '.join(warnings)})" if warnings else "")
        return {"status": "skipped" if optional else "missing", "why": why, "load_s": 0.0}
    start = time.monotonic()
    try:
        builder.load(verbose=False)
    except Exception as err:  # a compiler, ninja or a library missing: torch's build error, with its text
        return {"status": "missing", "why": f"load() failed: {type(err).__name__}: {error_summary(err)}",
                "load_s": time.monotonic() - start}
    return {"status": "ready", "why": "", "load_s": time.monotonic() - start}


def _collect_warnings(builder: Any) -> list[str]:
    """The messages the builder warns with from now on (DeepSpeed's ``OpBuilder.warning`` keeps only the last in
    ``error_log``; ``async_io``'s first says what is missing, its last where to point CFLAGS); still printed."""
    said: list[str] = []
    warn = getattr(builder, "warning", None)
    if callable(warn):
        def warning(msg: str) -> None:
            said.append(str(msg).strip())
            warn(msg)

        builder.warning = warning
    return said


def main(argv: list[str]) -> int:
    """``OUT.json BUILDER[:optional]...``."""
    for_planning()  # it measures nothing: fewer collections, none at exit (launchers/process/collector.py)
    keep_cpu_info()  # py-cpuinfo asked once per node (launchers/process/cpu_info.py)
    if len(argv) < 2:
        print("usage: python -m launchers.ops.op_load OUT.json BUILDER[:optional]...", file=sys.stderr)
        return 2
    out = Path(argv[0])
    report: dict[str, dict[str, Any]] = {}
    for spec in argv[1:]:
        builder_name, _, flag = spec.partition(":")
        print(f"dsopt: building or loading {builder_name}", flush=True)
        report[builder_name] = load_op(builder_name, optional=flag == "optional")
        print(f"dsopt: {builder_name}: {json.dumps(report[builder_name])}", flush=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
