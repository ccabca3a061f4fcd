"""``benchmarks/gpu_check.py`` on the CUDA devices of this machine (marked ``gpu``; skipped without one): every
row launches, bf16 rows agree with the FP32 reference, and the HF Trainer trains the ``--hf`` export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_its_grid_and_the_hf_export():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True,
                         text=True, timeout=1200, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith(("| gpt", "| llama"))]
    assert rows and not any("| crash |" in row or "| timeout |" in row for row in rows), run.stdout
    assert all("| ok |" in row for row in rows if "bf16" in row), run.stdout
    hf = next(line for line in run.stdout.splitlines() if line.startswith("HF Trainer"))
    assert "built partitioned True" in hf and "(falling)" in hf, hf
