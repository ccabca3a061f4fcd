"""The traced ledger against real DeepSpeed: a transformers Llama (SwiGLU, RMSNorm, GQA, rotary) from a local
config, 2 CPU ranks. The measured per-rank peak must land closer to the ledger with traced activations than to
the ledger with the formula (benchmarks/activation_sources.py reports the whole grid)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from launchers.trace import with_traced_activations
from launchers.trial import run_trial
from optimizer.knobs import with_knobs
from optimizer.ledger import compute_ledger
from optimizer.specs import ActivationSource, baseline_candidate
from optimizer.study_file import load_study
from optimizer.trial_result import Outcome

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    for name in ("llama-tiny-cpu.yaml", "llama-tiny-cpu.config.json"):
        shutil.copy(ROOT / "studies" / name, folder / name)
    return with_traced_activations(load_study(folder / "llama-tiny-cpu.yaml"))


@pytest.mark.parametrize("knobs", [{"precision": "bf16"}, {"zero_stage": 1, "checkpointing": "full"}])
def test_a_real_run_lands_closer_to_the_traced_ledger(llama, knobs):
    candidate = with_knobs(baseline_candidate(llama.training), knobs)
    result = run_trial(study=llama, candidate=candidate, reference_losses=None)
    assert result.outcome is Outcome.OK, result.message
    measured = result.peak_memory_bytes
    errors = {}
    for source in (ActivationSource.TRACE, ActivationSource.FORMULA):
        model = dataclasses.replace(llama.model, activations=source)
        ledger = compute_ledger(candidate=candidate, model=model, hardware=llama.hardware, training=llama.training)
        # CPU ranks: the measured live-tensor peak holds device and host items of the rank together
        errors[source] = (ledger.peak_bytes_at(ledger.host_locations) - measured) / measured
    assert abs(errors[ActivationSource.TRACE]) < abs(errors[ActivationSource.FORMULA]), errors
    assert abs(errors[ActivationSource.TRACE]) <= 0.05, errors
