"""Model construction on CUDA devices (marked ``gpu``; skipped without one): the init phase as DeepSpeed allocates
it with NCCL and the caching allocator, against the ledger — the part of ``tests/deepspeed/test_init_real.py``
that CPU ranks cannot show (device and host apart, reserved memory, a device-sized flat copy).

Uses every visible GPU up to 2 (one H100/H200 is enough to run it; two give ZeRO-3 a real partition).
"""

from __future__ import annotations

import pytest
import yaml

from launchers.trial import run_trial
from optimizer.ledger.core import compute_ledger
from optimizer.ledger.transformer import parameter_count
from optimizer.results.trial_result import Outcome
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _study(folder, *, model_init: str):
    gpus = min(2, torch.cuda.device_count())
    raw = {
        "name": f"init-cuda-{model_init}",
        "model": {"kind": "transformer", "layers": 24, "hidden_size": 1024, "heads": 16, "vocab_size": 32000,
                  "tied_embeddings": False, "attention": "fused", "mlp": "swiglu", "norm": "rmsnorm", "bias": False,
                  "position_embedding": "rope", "dropout": False},
        "hardware": {"accelerator": "cuda", "gpus_per_node": gpus, "gpu_memory": "80 GB"},
        "training": {"global_batch_size": 4 * gpus, "micro_batch_size": 4, "sequence_length": 1024,
                     "model_init": model_init},
        "trial": {"warmup_steps": 2, "measured_steps": 2},
        "search_space": {"knobs": {"zero_stage": [0, 1, 2, 3], "precision": ["fp32", "bf16"]}},
    }
    path = folder / f"init-cuda-{model_init}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_study(path)


@pytest.mark.parametrize("knobs", [{"zero_stage": 3, "precision": "bf16"}, {"zero_stage": 2, "precision": "bf16"}],
                         ids=["z3-bf16", "z2-bf16"])
def test_cuda_init_peak_against_the_ledger(tmp_path, knobs):
    study = _study(tmp_path, model_init="auto")
    candidate = with_knobs(baseline_candidate(study.training), knobs)
    result = run_trial(study=study, candidate=candidate)
    assert result.outcome is Outcome.OK, result.message + result.log_tail[-2000:]
    ledger = compute_ledger(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)
    measured = result.init_peak_memory_bytes
    print(f"{candidate.label()}: init peak measured {measured:,} B, ledger {ledger.init_bytes:,} B, "
          f"reserved {max(r.init_peak_reserved_bytes or 0 for r in result.ranks):,} B, init {result.init_s:.1f} s")
    assert abs(measured - ledger.init_bytes) / measured < 0.15
    if knobs["zero_stage"] == 3 and study.hardware.world_size > 1:  # a partition, never the whole bf16 model
        assert max(r.build_peak_allocated_bytes for r in result.ranks) < 2 * parameter_count(study.model)
