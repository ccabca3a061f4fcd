"""DeepSpeed's Muon kernels compiled on first call, and the CPU profiler started without torch's compiler imports
(launchers/process/lazy_compile.py, launchers/measure/cpu_memory.py): a rank no longer imports ``torch._inductor``. The
deferral itself is tested in tests/launchers/models/test_deferred_compile.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _fresh(code: str) -> dict:
    """What ``code`` (run in a fresh interpreter on CPU ranks' settings) printed as its last line, as JSON."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          check=True, cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)})
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_deepspeeds_muon_module_imports_without_torchs_compiler_once_installed():
    code = """
        import json, sys
        import deepspeed
        from launchers.process import lazy_compile
        installed = lazy_compile.install() if INSTALL else False
        from deepspeed.runtime.zero.muon import original_muon
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # what every ZeRO engine imports
        wrapper = lazy_compile.compiled_on_first_call(len).__code__  # the code of every lazily compiled kernel
        kernels = [original_muon.zeropower_via_newtonschulz5, original_muon.zeropower_via_gram_newtonschulz,
                   original_muon.muon_update]
        print(json.dumps({"installed": installed, "inductor": "torch._inductor" in sys.modules,
                          "lazy": [getattr(k, "__code__", None) is wrapper for k in kernels]}))
        """
    without = _fresh(code.replace("INSTALL", "False"))
    # the control: DeepSpeed 0.19.8's decorators import torch's compiler and compile the kernels as they are
    assert without == {"installed": False, "inductor": True, "lazy": [False, False, False]}
    once = _fresh(code.replace("INSTALL", "True"))
    assert once == {"installed": True, "inductor": False, "lazy": [True, True, True]}


def test_the_cpu_profiler_counts_the_same_bytes_without_importing_torchs_compiler():
    peaks = _fresh("""
        import json, sys
        import torch
        from launchers.measure.cpu_memory import start_cpu_profiler, stop_cpu_profiler
        profiler = start_cpu_profiler()
        with torch.profiler.record_function("made"):
            kept = torch.ones(1000)
            gone = torch.ones(500)
            del gone
        peaks = stop_cpu_profiler(profiler, ranges=("made",))
        print(json.dumps({"peak": peaks.peak, "final": peaks.final, "until": peaks.until,
                          "inductor": "torch._inductor" in sys.modules}))
        """)
    assert peaks == {"peak": 6000, "final": 4000, "until": {"made": 6000}, "inductor": False}
