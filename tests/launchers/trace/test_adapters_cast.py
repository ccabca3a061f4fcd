"""A ZeRO-3 trace holds PEFT's adapters as the engine will: fp32 where zero.Init built the model, in the training
dtype where the engine casts it (``training.model_init: full`` or ``device``, a 4-bit base) — one predicate,
``optimizer.study.constraints.zero3_keeps_adapters_fp32``, decides both the ledger and the trace."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from optimizer.study.constraints import adapters_kept_fp32, zero3_keeps_adapters_fp32
from optimizer.study.knobs import Precision, with_knobs
from optimizer.study.specs import ModelInit, baseline_candidate
from optimizer.study.study_file import load_study
from optimizer.study.traced_activation import ADAPTERS_CAST, ZERO3_RUN

ROOT = Path(__file__).resolve().parents[3]
LORA = ROOT / "studies" / "grid-lora-llama-cpu.yaml"


def test_the_predicate_follows_the_construction_and_the_base():
    study = load_study(LORA)
    assert zero3_keeps_adapters_fp32(model=study.model, training=study.training)  # auto: zero.Init at stage 3
    for init, kept in ((ModelInit.ZERO_INIT, True), (ModelInit.FULL, False), (ModelInit.DEVICE, False)):
        training = dataclasses.replace(study.training, model_init=init)
        assert zero3_keeps_adapters_fp32(model=study.model, training=training) is kept, init
        z3_bf16 = with_knobs(baseline_candidate(training), {"zero_stage": 3, "precision": "bf16"})
        assert adapters_kept_fp32(model=study.model, candidate=z3_bf16, training=training) is kept
    four_bit = dataclasses.replace(study.model, quantization='{"load_in_4bit": true}')
    assert not zero3_keeps_adapters_fp32(model=four_bit, training=study.training)


def test_a_zero3_trace_of_cast_adapters_holds_less_than_of_fp32_ones():
    pytest.importorskip("peft")
    from launchers.trace.inventory import with_inventory
    from launchers.trace.tracer import TraceResult, trace
    from launchers.trial.run import model_dict

    study = with_inventory(load_study(LORA))
    spec = {**model_dict(study.model), ZERO3_RUN: True}
    seq = study.training.sequence_length
    kept, cast = (trace(model_spec=s, checkpointing="none", precision=Precision.BF16, micro_batch=1,
                        sequence_length=seq) for s in (spec, {**spec, ADAPTERS_CAST: True}))
    assert isinstance(kept, TraceResult) and isinstance(cast, TraceResult), (kept, cast)
    # fp32 adapters: lora_A's input cast to fp32 (lora/layer.py:1100) and both adapters' outputs in fp32
    assert kept.activation_peak_bytes > cast.activation_peak_bytes, (kept, cast)
    assert kept.parameters == cast.parameters
