"""DeepSpeed's own op builders, for real on CPU ranks, as dsopt's op preparation runs them before a study's first
launch (launchers/study/op_prep.py, launchers/ops/op_load.py). The suite's first build runs in the background from
the session's start (tests/conftest.py); this test then finds it done, or builds."""

from __future__ import annotations

import importlib
import json
import shutil
import time

import pytest
from ops_study import ops_study

import launchers.study.op_prep as op_prep
from launchers.ops.op_needs import ASYNC_IO, CPU_ADAM, FUSED_ADAM, SHM_COMM
from optimizer.study.knobs import OffloadDevice

pytestmark = pytest.mark.slow
NONE = OffloadDevice.NONE


def test_deepspeeds_own_builders_build_or_load_the_study_ops(tmp_path):
    """Real DeepSpeed builders on CPU ranks: the ops of a CPU study with NVMe offload are ready (cached in the
    session's TORCH_EXTENSIONS_DIR after their first build: the session's background build of tests/conftest.py, or
    this test's own), async_io too where libaio is installed; where it is not, its candidates are ruled out with the
    reason, not launched."""
    cpu_builders = importlib.import_module("deepspeed.ops.op_builder.cpu")
    for op in (SHM_COMM, FUSED_ADAM, CPU_ADAM, ASYNC_IO):
        assert op.name == getattr(cpu_builders, op.builder).NAME
    spec = ops_study(tmp_path, nvme=True, offload_optimizer=("none", "cpu", "nvme"))
    said: list[str] = []
    start = time.monotonic()
    narrowed = op_prep.prepare_ops(spec=spec, gpus=None, worker="w0", say=said.append)
    print(f"ops prepared in {time.monotonic() - start:.1f} s:", *said, sep="\n")
    report = json.loads(next((spec.output_dir / "ops").glob("*.json")).read_text())
    for builder in ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder"):
        assert report[builder]["status"] == "ready", report
    if report["AsyncIOBuilder"]["status"] == "ready":
        assert narrowed is spec
    else:
        assert shutil.which("c++") is None or "libaio" in report["AsyncIOBuilder"]["why"]
        assert any("async_io" in line and "rules out" in line for line in said)
        assert dict(narrowed.search_space.values)["offload_param"] == (NONE,)
