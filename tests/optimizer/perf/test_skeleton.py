"""The skeleton the probe times DeepSpeed's engine on: the study's structure at a tiny width, with as many buckets
(pure; tests/real/deepspeed/test_probe_real.py builds and times real ones)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from optimizer.deepspeed.zero_settings import zero_settings
from optimizer.ledger.transformer import parameter_count, parameter_tensors
from optimizer.perf.probe_plan import probe_plan
from optimizer.perf.skeleton import SKELETON_MIN_HIDDEN, skeleton_model
from optimizer.study.hf_config import shape_from_hf_config
from optimizer.study.knobs import Precision, ZeroStage
from optimizer.study.specs import MlpKind, TransformerModel
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]

LLAMA_70B = TransformerModel(layers=80, hidden_size=8192, heads=64, kv_heads=8, ffn_size=28672, vocab_size=128256,
                             mlp=MlpKind.SWIGLU, tied_embeddings=False, bias=False)


@pytest.mark.parametrize("model", [LLAMA_70B, load_study(ROOT / "studies" / "grid-cpu.yaml").model,
                                   TransformerModel(layers=3, hidden_size=96, heads=3, kv_heads=1, ffn_size=200,
                                                    vocab_size=1000)])
def test_the_skeleton_keeps_the_structure_and_the_number_of_buckets(model):
    small = skeleton_model(model)
    assert isinstance(small, TransformerModel)
    kept = ("layers", "heads", "kv_heads", "mlp", "norm", "bias", "tied_embeddings", "position_embedding", "attention")
    assert all(getattr(small, name) == getattr(model, name) for name in kept)
    assert SKELETON_MIN_HIDDEN <= small.hidden_size <= max(SKELETON_MIN_HIDDEN, model.hidden_size)
    assert small.head_dim % 2 == 0  # rotary embeddings pair the dimensions
    assert len(parameter_tensors(small)) == len(parameter_tensors(model))  # every module and tensor, narrower

    def buckets(m: TransformerModel) -> float:  # ZeRO-1/2 reduce calls of one gradient pass at dsopt's bucket size
        return parameter_count(m) / zero_settings(model=m, stage=ZeroStage.GRADIENTS).reduce_bucket_elements

    assert buckets(small) == pytest.approx(buckets(model), rel=0.15)
    threshold = zero_settings(model=small, stage=ZeroStage.PARAMETERS).param_persistence_threshold
    big_threshold = zero_settings(model=model, stage=ZeroStage.PARAMETERS).param_persistence_threshold
    # the tensors ZeRO-3 partitions (over the persistence threshold) are the same ones
    assert [t.numel > threshold for t in parameter_tensors(small)] == \
        [t.numel > big_threshold for t in parameter_tensors(model)]


def test_a_transformers_config_is_shrunk_under_its_own_keys():
    model = load_study(ROOT / "studies" / "grid-qwen2-cpu.yaml").model
    small = skeleton_model(model)
    assert isinstance(small, TransformerModel) and small.hf_config is not None
    shape = shape_from_hf_config(json.loads(small.hf_config))
    assert (shape["hidden_size"], shape["ffn_size"], shape["vocab_size"], shape["layers"], shape["kv_heads"]) == \
        (small.hidden_size, small.ffn_size, small.vocab_size, model.layers, model.kv_heads)
    gpt2 = replace(model, hf_config=json.dumps({"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 2,
                                                "n_inner": None, "vocab_size": 50257}), heads=12, kv_heads=12,
                   hidden_size=768, ffn_size=3072, vocab_size=50257)
    config = json.loads(skeleton_model(gpt2).hf_config)
    assert config["n_embd"] == 12 * 4 and config["n_inner"] is None and config["vocab_size"] < 50257
    config = {**json.loads(gpt2.hf_config), "n_positions": 1024}
    learned = replace(gpt2, position_embedding="learned", max_positions=1024, hf_config=json.dumps(config))
    assert json.loads(skeleton_model(learned).hf_config)["n_positions"] == round(1024 * 48 / 768)


def test_a_model_built_by_the_users_code_has_no_skeleton():
    model = TransformerModel(layers=2, hidden_size=64, heads=4, kv_heads=4, ffn_size=256, vocab_size=256,
                             entry_point="mine:build")
    assert "its own code (mine:build)" in skeleton_model(model)
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    plan = probe_plan(replace(study, model=model))
    assert plan.engine_stages == () and "mine:build" in plan.engine_skipped


def test_the_plan_times_each_stage_of_the_space_in_its_16_bit_precision():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    plan = probe_plan(study)
    assert plan.engine_stages == (0, 1, 2, 3) and plan.engine_precision == "bf16" and plan.engine_skipped == ""
    narrow = replace(study, search_space=replace(study.search_space, values=(
        ("zero_stage", (ZeroStage.GRADIENTS,)), ("precision", (Precision.FP32,)))))
    plan = probe_plan(narrow)
    assert plan.engine_stages == (2,) and plan.engine_precision == "fp32"
