"""Hugging Face configs as models (optimizer/study/hf_config.py, study_file): the shape they give, and every bad one
refused naming the file and the key, exit 2."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from optimizer.cli import main
from optimizer.ledger.core import evaluate
from optimizer.ledger.transformer import parameter_count
from optimizer.study.errors import UserError
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import (
    ActivationSource,
    MlpKind,
    NormKind,
    PositionKind,
    TransformerModel,
    baseline_candidate,
)
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]

# The shape of Llama-2-7B's config.json (meta-llama/Llama-2-7b-hf), written out: nothing is downloaded.
LLAMA_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "max_position_embeddings": 4096, "tie_word_embeddings": False, "attention_bias": False}

STUDY = """
name: hf
model:
  kind: transformer
  hf_config: {config}
hardware:
  accelerator: cpu
  gpus_per_node: 2
  gpu_memory: 8 GiB
training:
  global_batch_size: 8
  micro_batch_size: 2
  sequence_length: 32
search_space:
  knobs:
    checkpointing: [none, full, selective]
"""


def _study(tmp_path, config, *, inline=False, extra=""):
    if inline:
        reference = json.dumps(config)
    else:
        (tmp_path / "config.json").write_text(json.dumps(config))
        reference = "config.json"
    path = tmp_path / "study.yaml"
    path.write_text(textwrap.dedent(STUDY).replace("{config}", reference).replace("model:\n", "model:\n" + extra))
    return path


def test_a_config_file_gives_the_llama_shape(tmp_path):
    study = load_study(_study(tmp_path, LLAMA_7B))
    model = study.model
    assert isinstance(model, TransformerModel) and model.hf_config is not None
    assert (model.layers, model.hidden_size, model.heads, model.kv_heads, model.ffn_size) == (32, 4096, 32, 32, 11008)
    assert (model.mlp, model.norm, model.position_embedding, model.bias, model.dropout, model.tied_embeddings) == \
        (MlpKind.SWIGLU, NormKind.RMSNORM, PositionKind.ROPE, False, False, False)
    assert parameter_count(model) == 6_738_415_616  # Llama-2-7B's published count (Touvron et al. 2023)
    assert model.activations is ActivationSource.AUTO  # traced by the commands, the formula where that fails


def test_an_inline_config_is_the_same_model(tmp_path):
    assert load_study(_study(tmp_path, LLAMA_7B, inline=True)).model == load_study(_study(tmp_path, LLAMA_7B)).model


def test_an_inline_yaml_1_1_exponent_is_the_number_json_means(tmp_path):
    path = tmp_path / "study.yaml"
    inline = json.dumps(LLAMA_7B).replace("}", ', "rms_norm_eps": 1e-6}')  # JSON in YAML: PyYAML reads a string
    path.write_text(textwrap.dedent(STUDY).replace("{config}", inline))
    config = json.loads(load_study(path).model.hf_config)
    assert config["rms_norm_eps"] == 1e-6 and isinstance(config["rms_norm_eps"], float)


def test_selective_checkpointing_is_invalid_for_a_transformers_model(tmp_path):
    study = load_study(_study(tmp_path, LLAMA_7B))
    candidate = with_knobs(baseline_candidate(study.training), {"checkpointing": "selective"})
    verdict = evaluate(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)
    assert verdict.ledger is None and "whole layers only" in verdict.invalid_reasons[0]


@pytest.mark.parametrize(
    ("change", "key", "why"),
    [
        ({"model_type": "no_such_family"}, "model_type", "not a model type transformers"),
        ({"model_type": "vit"}, "model_type", "no causal-LM model"),  # transformers knows it: an image encoder
        ({"model_type": 7}, "model_type", "expected a string"),
        ({"hidden_size": None}, "hidden_size", "missing"),
        ({"num_hidden_layers": "32"}, "num_hidden_layers", "positive integer"),
        ({"head_dim": 256}, "head_dim", "differs"),
        ({"mlp_bias": True}, "mlp_bias", "both"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "true or false"),  # bool("false") is True
        ({"attention_bias": "false"}, "attention_bias", "true or false"),
        ({"num_key_value_heads": 0}, "num_key_value_heads", "positive integer"),  # would become the default
        ({"max_position_embeddings": 0}, "max_position_embeddings", "positive integer"),
        ({"attention_dropout": [1]}, "attention_dropout", "expected a number"),
        # Shape errors name the config's own key, not the study's (kv_heads, hidden_size):
        ({"num_key_value_heads": 3}, "num_key_value_heads", "do not divide 32 heads"),
        ({"num_attention_heads": 30}, "num_attention_heads", "does not divide hidden_size 4096"),
        # Counts beyond any real model (optimizer/study/limits.py), refused before anything is built:
        ({"num_hidden_layers": 10**6}, "num_hidden_layers", "beyond any real layer count"),
        ({"intermediate_size": 10**9}, "intermediate_size", "beyond any real MLP width"),
        ({"vocab_size": 10**9}, "vocab_size", "beyond any real vocabulary"),
    ],
)
def test_a_bad_config_names_its_file_and_key(tmp_path, change, key, why):
    config = {k: v for k, v in {**LLAMA_7B, **change}.items() if v is not None}
    with pytest.raises(UserError) as info:
        load_study(_study(tmp_path, config))
    assert info.value.source == str(tmp_path / "config.json") and info.value.key == key and why in info.value.why
    with pytest.raises(UserError) as inline:
        load_study(_study(tmp_path, config, inline=True))
    assert inline.value.source == str(tmp_path / "study.yaml") and inline.value.key == f"model.hf_config.{key}"


def test_shape_keys_beside_a_config_are_refused(tmp_path):
    with pytest.raises(UserError) as info:
        load_study(_study(tmp_path, LLAMA_7B, extra="  layers: 4\n"))
    assert info.value.key == "model.layers" and "comes from hf_config" in info.value.why


def test_a_missing_or_broken_config_file_exits_2(tmp_path, capsys):
    path = _study(tmp_path, LLAMA_7B)
    (tmp_path / "config.json").unlink()
    assert main(["ledger", str(path)]) == 2
    assert "model.hf_config: no such file" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert main(["ledger", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json" in err and "not a JSON config" in err
    for text, needle in (('{"model_type": "llama", "model_type": "gpt2"}', "duplicate key 'model_type'"),
                         ('{"model_type": "llama", "rms_norm_eps": NaN}', "NaN is not a JSON number")):
        (tmp_path / "config.json").write_text(text)
        assert main(["ledger", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("dtype_key", ["torch_dtype", "dtype"])
def test_the_candidates_dtype_wins_over_the_configs(tmp_path, dtype_key):
    # Llama-2's config.json says "torch_dtype": "float16"; an FP32 candidate and the FP32 reference must still
    # build (and train) in FP32, a bf16 candidate in bf16.
    pytest.importorskip("transformers")
    import torch

    from launchers.models.hf_model import build_hf_model
    from launchers.trial.run import model_dict

    tiny = json.loads((ROOT / "studies" / "llama-tiny-cpu.config.json").read_text())
    config = {**tiny, dtype_key: "float16"}
    study = load_study(_study(tmp_path, config))  # the study accepts the key as transformers writes it
    planned = model_dict(study.model)["hf_config"]  # what the ranks receive
    assert planned[dtype_key] == "float16"
    for dtype in (torch.float32, torch.bfloat16):
        model = build_hf_model(planned, attention="eager", checkpointing="none", dtype=dtype)
        assert {p.dtype for p in model.parameters()} == {dtype}


GPT2_TINY = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}


@pytest.mark.parametrize(
    ("change", "key", "why"),
    [
        ({"n_head": 5}, "n_head", "does not divide n_embd 64"),  # GPT-2's own names, not transformers' common ones
        ({"n_layer": 10**8}, "n_layer", "beyond any real layer count"),  # before transformers builds 10^8 of anything
        ({"n_embd": 0}, "n_embd", "positive integer"),
    ],
)
def test_a_bad_family_config_names_the_key_as_the_file_spells_it(tmp_path, change, key, why):
    with pytest.raises(UserError) as info:
        load_study(_study(tmp_path, {**GPT2_TINY, **change}))
    assert info.value.source == str(tmp_path / "config.json") and info.value.key == key and why in info.value.why
