"""The device as the driver sees it, on a real CUDA device (marked ``gpu``; skipped without one): the reader of
launchers/measure/device_memory.py in a fresh process (no CUDA context yet), and one real trial's rank reports —
what tests/launchers/measure/test_device_memory.py checks with fakes only. Not yet run on a GPU (docs/trials.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launchers.trial.run import run_trial
from optimizer.results.device_budget import measured_device_reserve
from optimizer.results.trial_result import Outcome
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[3]
GiB = 2**30

PROBE = """
import json, torch
from launchers.measure.device_memory import DeviceMemory
memory = DeviceMemory.open(cuda=True, index=0)
torch.cuda.set_device(0)
block = torch.empty(GIB, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
memory.sample(init=True)
print(json.dumps({**memory.report(), "reserved": torch.cuda.memory_reserved(0)}))
""".replace("GIB", str(GiB))


def test_a_fresh_process_sees_its_context_and_its_gibibyte():
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    print(report)
    assert report["device_memory_source"] in ("nvml_process", "nvml_device", "cuda_mem_get_info")
    assert report["device_used_init_bytes"] >= report["reserved"] >= GiB
    # The CUDA context (lazy loading: ~0.3 GB, docs/sources.md) is outside PyTorch's pool, and well under 4 GiB.
    assert 50 * 2**20 < report["device_non_torch_init_bytes"] < 4 * GiB


def test_a_real_trial_reports_the_device_and_its_reserve(tmp_path):
    raw = yaml.safe_load((ROOT / "studies" / "cpu-tiny.yaml").read_text())
    raw["hardware"] = {"accelerator": "cuda", "gpus_per_node": 1, "gpu_memory": "16 GiB"}
    raw["search_space"] = {"knobs": {"zero_stage": [0], "precision": ["fp32"]}}
    path = tmp_path / "cuda-tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    study = load_study(path)
    result = run_trial(study=study, candidate=baseline_candidate(study.training))
    assert result.outcome is Outcome.OK, result.message + result.log_tail[-2000:]
    rank = result.ranks[0]
    print(rank)
    assert rank.device_used_init_bytes > rank.init_peak_reserved_bytes
    assert rank.device_used_peak_bytes >= rank.device_used_init_bytes
    reserve = measured_device_reserve(result)
    assert reserve is not None and 50 * 2**20 < reserve < 4 * GiB
    assert result.device_total_bytes is not None and result.device_total_bytes > 16 * GiB
