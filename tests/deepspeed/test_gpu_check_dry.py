"""``benchmarks/gpu_check.py --dry-run``: the GPU check's whole pipeline on 2 CPU ranks (its GPU twin is
``tests/gpu/test_gpu_check.py``): real trials printed beside the ledger, an fp16 row recorded as data, and the
``--hf`` export of a ZeRO-3 candidate trained under the Hugging Face Trainer, built partitioned."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_measures_records_fp16_and_trains_the_hf_export():
    pytest.importorskip("transformers")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--only", "llama",
                          "--rows", "3"], capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| llama")]
    assert len(rows) == 3, run.stdout
    assert "| ok |" in rows[0] and "| ok |" in rows[2]  # z0 bf16, z3 bf16
    assert "| unsupported |" in rows[1] or "| ok |" in rows[1]  # fp16: the CPU decides, either is data
    hf = next(line for line in run.stdout.splitlines() if line.startswith("HF Trainer"))
    assert "'zero_stage': 3" in hf and "built partitioned True" in hf and "(falling)" in hf, hf
