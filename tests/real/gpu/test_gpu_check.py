"""``benchmarks/gpu_check.py`` on the CUDA devices of this machine (marked ``gpu``; skipped without one): every row of
its grid ran ``ok`` with figures, both peaks inside the ledger's band and the fidelity within tolerance (the script's
own check, :func:`gpu_check.verdict`), and the HF Trainer trained the ``--hf`` export partitioned."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[3]
FIGURE = r"[\d,.]+"
OK_ROW = re.compile(rf"^\| (gpt|llama) ×\d+ .+ \| ok \| {FIGURE} \({FIGURE}–{FIGURE}\) \| {FIGURE} / {FIGURE} "
                    rf"\([+-][\d.]+%\) \| {FIGURE} \({FIGURE}–{FIGURE}\) \| {FIGURE} / {FIGURE} \([+-][\d.]+%\) \| "
                    rf"{FIGURE} \| \d+ \| [\d.]+e[+-]\d+ \| pass \|$")


def test_every_row_of_the_gpu_check_agrees_with_the_ledger_and_the_reference():
    gpus = min(8, torch.cuda.device_count())
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True,
                         text=True, timeout=900, check=False)
    rows = [line for line in run.stdout.splitlines() if line.startswith(("| gpt", "| llama"))]
    assert len(rows) == (14 if gpus > 1 else 12), run.stdout + run.stderr[-3000:]
    failing = [row for row in rows if not OK_ROW.match(row)]
    assert not failing, "\n".join(failing)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    hf = next(line for line in run.stdout.splitlines() if line.startswith("HF Trainer"))
    assert "'zero_stage': 3" in hf and "built partitioned True" in hf and "(falling)" in hf, hf
