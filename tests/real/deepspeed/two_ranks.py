"""Start a rank program on 2 CPU ranks with torchrun (``DS_ACCELERATOR=cpu``, gloo), as the real tests need."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from launchers.trial.local import clear_stale_build_locks, extensions_dir
from optimizer.study.knobs import Precision
from optimizer.study.specs import Accelerator, HardwareSpec, TransformerModel

TINY_MODEL = TransformerModel(layers=2, hidden_size=64, heads=4, kv_heads=4, ffn_size=256, vocab_size=256,
                              max_positions=32)
"""The real model-state tests' model: small enough for seconds per run, every ZeRO item non-zero."""
TWO_CPU_RANKS = HardwareSpec(accelerator=Accelerator.CPU, gpus_per_node=2, gpu_memory_bytes=4 * 2**30,
                             supported_precisions=(Precision.FP32, Precision.BF16))
"""The hardware of :func:`run_two_ranks`."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_ranks(program: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 program args…`` on loopback; asserts it exited 0 (its output's tail if not)."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    clear_stale_build_locks(extensions_dir())
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_EXTENSIONS_DIR=str(extensions_dir()))
    argv = [torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            str(program), *args]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
