"""``benchmarks/gpu_check.py --dry-run``: the GPU check's whole pipeline on 2 CPU ranks (its GPU twin is
``tests/real/gpu/test_gpu_check.py``) with the same band: real trials whose measured peaks fall inside the ledger's band
with a fidelity within tolerance, an fp16 row that is ``ok`` exactly where DeepSpeed's CPU accelerator takes fp16,
and the ``--hf`` export of a ZeRO-3 candidate trained under the Hugging Face Trainer, built partitioned."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


def _cpu_takes_fp16() -> bool:
    """DeepSpeed's own answer, asked in a fresh process the way a CPU rank asks it."""
    probe = "from deepspeed.accelerator import get_accelerator; print(get_accelerator().is_fp16_supported())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return out.stdout.strip().splitlines()[-1] == "True"


def test_the_dry_run_agrees_with_the_ledger_and_trains_the_hf_export():
    pytest.importorskip("transformers")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--only", "llama"],
                         capture_output=True, text=True, timeout=900, check=False)
    rows = [line for line in run.stdout.splitlines() if line.startswith("| llama")]
    assert len(rows) == 3, run.stdout + run.stderr[-3000:]
    z0_bf16, z3_bf16, z3_fp16 = rows
    assert "| ok |" in z0_bf16 and z0_bf16.endswith("| pass |"), z0_bf16
    assert "| ok |" in z3_bf16 and z3_bf16.endswith("| pass |"), z3_bf16
    if _cpu_takes_fp16():
        assert "| ok |" in z3_fp16 and z3_fp16.endswith("| pass |"), z3_fp16
    else:
        assert "| unsupported |" in z3_fp16, z3_fp16
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    hf = next(line for line in run.stdout.splitlines() if line.startswith("HF Trainer"))
    assert "'zero_stage': 3" in hf and "built partitioned True" in hf and "(falling)" in hf, hf
