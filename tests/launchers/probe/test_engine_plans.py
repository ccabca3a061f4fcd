"""The probe's engines run on the study's skeleton with as many ZeRO gradient buckets per pass as the study's own
run, also where only PEFT's adapters or part of the model train (launchers/probe/machine.py ``engine_plans``,
optimizer/perf/skeleton.py ``skeleton_bucket_elements``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from launchers.probe.machine import engine_plans, pass_plans
from launchers.trace.inventory import adapted_inventory
from optimizer.deepspeed.zero_settings import zero_settings
from optimizer.ledger.transformer import trainable_tensors
from optimizer.perf.model_pass import intercept_tokens
from optimizer.perf.probe_plan import probe_plan
from optimizer.perf.skeleton import skeleton_model
from optimizer.study.knobs import ZeroStage
from optimizer.study.machine_probe import PASS_INTERCEPT
from optimizer.study.specs import ModelInit
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]


def flushes(sizes: list[int], bucket: int) -> int:
    """Bucket reductions of one gradient pass: DeepSpeed takes the gradients in backward order and reduces the bucket
    when the next would overflow it, then the rest at the end (stage_1_and_2.py
    ``reduce_independent_p_g_buckets_and_remove_grads``)."""
    count = filled = 0
    for size in reversed(sizes):
        if filled and filled + size > bucket:
            count, filled = count + 1, 0
        filled += size
    return count + (filled > 0)


def _plans(name: str):
    spec = adapted_inventory(load_study(ROOT / "studies" / f"{name}.yaml"))
    plan = probe_plan(spec)
    skeleton = adapted_inventory(replace(spec, model=skeleton_model(spec.model))).model
    return spec, skeleton, engine_plans(spec, plan)


@pytest.mark.parametrize("name", ["grid-lora-gpt2-cpu", "grid-lora-llama-cpu", "grid-qlora-llama-cpu"])
def test_a_peft_skeleton_reduces_as_many_buckets_as_the_study(name):
    spec, skeleton, engines = _plans(name)
    study_bucket = zero_settings(model=spec.model, stage=ZeroStage.GRADIENTS).reduce_bucket_elements
    study_sizes = [t.numel for t in trainable_tensors(spec.model)]
    skeleton_sizes = [t.numel for t in trainable_tensors(skeleton)]
    assert len(skeleton_sizes) == len(study_sizes)  # the same adapters, narrower
    wanted = flushes(study_sizes, study_bucket)
    staged = [e for e in engines if e["stage"] in (1, 2)]
    assert staged
    for engine in staged:
        zero = engine["config"]["zero_optimization"]
        assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"]
        assert zero["reduce_bucket_size"] % 4 == 0
        assert flushes(skeleton_sizes, zero["reduce_bucket_size"]) == wanted
    # dsopt's h² rule at the skeleton's width would have split the adapters' gradients into more buckets
    squared = zero_settings(model=skeleton, stage=ZeroStage.GRADIENTS).reduce_bucket_elements
    assert flushes(skeleton_sizes, squared) > wanted


def test_a_full_fine_tune_s_skeleton_keeps_dsopt_s_own_bucket():
    _, skeleton, engines = _plans("grid-cpu")
    squared = zero_settings(model=skeleton, stage=ZeroStage.GRADIENTS).reduce_bucket_elements
    assert all(e["config"]["zero_optimization"]["reduce_bucket_size"] == squared for e in engines)


@pytest.mark.parametrize("name", ["grid-qlora-llama-cpu", "grid-reference-lora-llama-cpu"])
def test_the_model_passes_build_the_study_model_two_blocks_deep_in_each_precision(name):
    spec = adapted_inventory(load_study(ROOT / "studies" / f"{name}.yaml"))
    plan = probe_plan(spec)
    passes = pass_plans(spec, plan)
    assert [p["precision"] for p in passes] == list(plan.precisions)
    for one in passes:
        assert one["model"]["layers"] == plan.pass_layers == 2
        assert one["model"]["hf_config"]["num_hidden_layers"] == 2
        assert one["model"]["peft"]["target_modules"] == json.loads(spec.model.peft)["target_modules"]
        assert one["config"]["zero_optimization"].get("stage", 0) == 0 and one["checkpointing"] == "none"
        timed = [(p["micro_batch"], p["variant"]) for p in one["passes"]]
        assert timed == [(0, PASS_INTERCEPT)] + [(b, "") for b in plan.micro_batches]  # the intercept first
        rows = {p["variant"] or p["micro_batch"]: (p["rows"], p["tokens"]) for p in one["passes"]}
        assert rows[PASS_INTERCEPT] == (spec.model.rows(1), intercept_tokens(spec.training.sequence_length))
        assert all(rows[b] == (spec.model.rows(b), spec.training.sequence_length) for b in plan.micro_batches)
        # the FLOPs grow with the rows; a 4-bit base's dequantization is once per matmul, whatever the rows
        terms = {p["micro_batch"]: dict(p["terms"]) for p in one["passes"] if not p["variant"]}
        low, high = min(terms), max(terms)
        for name, amount in terms[high].items():
            expected = terms[low][name] * (1 if name == "dequant_bytes" else high / low)
            assert amount == pytest.approx(expected)


def test_a_study_built_under_zero_init_has_its_passes_built_on_the_device():
    spec = load_study(ROOT / "studies" / "grid-lora-llama-cpu.yaml")
    staged = replace(spec, training=replace(spec.training, model_init=ModelInit.ZERO_INIT),
                     search_space=replace(spec.search_space, values=(("zero_stage", (ZeroStage.PARAMETERS,)),)))
    passes = pass_plans(adapted_inventory(staged), probe_plan(staged))
    assert passes and {p["construction"] for p in passes} == {"device"}
