"""Causal-LM families beyond Llama, from local configs (nothing downloaded): each loads as a study, its parameters
are counted from the model itself (the inventory equals transformers' ``num_parameters()``), and ``dsopt ledger``
prices it. The configs are tiny versions of each family's published config.json, keeping its distinctive keys."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from launchers.trace.inventory import with_inventory  # noqa: E402
from optimizer.cli import main  # noqa: E402
from optimizer.ledger.transformer import largest_layer_parameters, parameter_count  # noqa: E402
from optimizer.study.study_file import load_study  # noqa: E402

FAMILIES_FILE = Path(__file__).parents[2] / "data" / "hf_families.json"
"""Each family's tiny config and what is distinctive about it (also read by benchmarks/hf_families.py)."""
FAMILIES = {name: entry["config"] for name, entry in json.loads(FAMILIES_FILE.read_text()).items()}
STUDY = """
name: family
model:
  kind: transformer
  hf_config: config.json
  attention: fused
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
    zero_stage: [0, 3]
"""


def _study(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "family.yaml"
    path.write_text(textwrap.dedent(STUDY))
    return path


def _real(config):
    settings = dict(config)
    hf = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    return transformers.AutoModelForCausalLM.from_config(hf)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_is_priced_from_its_own_parameters(tmp_path, family, capsys):
    config = FAMILIES[family]
    study = with_inventory(load_study(_study(tmp_path, config)))
    real = _real(config)
    inventory = study.model.inventory
    assert inventory is not None and inventory.model_class == type(real).__name__
    assert parameter_count(study.model) == inventory.parameters == real.num_parameters()
    own = {name: sum(p.numel() for p in m.parameters(recurse=False)) for name, m in real.named_modules()}
    assert largest_layer_parameters(study.model) == max(own.values())
    assert main(["ledger", str(study.path), "--set", "zero_stage=3"]) == 0
    out = capsys.readouterr().out
    assert f"Ψ = {real.num_parameters():,} parameters" in out and "Parameter inventory" in out


def test_the_families_shape_keys_are_read_through_transformers(tmp_path):
    gpt2 = load_study(_study(tmp_path, FAMILIES["gpt2"])).model
    assert (gpt2.layers, gpt2.hidden_size, gpt2.heads, gpt2.ffn_size, gpt2.max_positions) == (2, 64, 4, 256, 128)
    assert (str(gpt2.mlp), str(gpt2.norm), str(gpt2.position_embedding), gpt2.tied_embeddings) == \
        ("gelu", "layernorm", "learned", True)
    opt = load_study(_study(tmp_path, FAMILIES["opt"])).model
    assert opt.ffn_size == 256
    qwen = load_study(_study(tmp_path, FAMILIES["qwen2"])).model
    assert (qwen.kv_heads, str(qwen.mlp), str(qwen.norm)) == (2, "swiglu", "rmsnorm")


@pytest.mark.parametrize(("change", "key", "needle"), [
    ({"intermediate_size": 0}, "intermediate_size", "positive integer"),  # not "unset": 4h would be a guess
    ({"num_key_value_heads": 0}, "num_key_value_heads", "positive integer"),
    ({"hidden_size": "64"}, "model_type", "hidden_size"),  # transformers' validator: field and reason both said
])
def test_a_bad_value_in_another_familys_config_names_it(tmp_path, change, key, needle):
    from optimizer.study.errors import UserError

    with pytest.raises(UserError) as info:
        load_study(_study(tmp_path, {**FAMILIES["qwen2"], **change}))
    assert info.value.key == key and needle in info.value.why, info.value.why


def test_a_model_without_attention_heads_is_refused_saying_so(tmp_path):
    from optimizer.study.errors import UserError

    mamba = {"model_type": "mamba", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "state_size": 8}
    with pytest.raises(UserError) as info:
        load_study(_study(tmp_path, mamba))
    assert "no attention heads" in info.value.why


def test_a_family_without_a_position_table_takes_the_default(tmp_path):
    xlnet = {"model_type": "xlnet", "vocab_size": 512, "d_model": 64, "n_layer": 2, "n_head": 4, "d_inner": 128}
    study = with_inventory(load_study(_study(tmp_path, xlnet)))
    assert study.model.max_positions == 2048 and parameter_count(study.model) == _real(xlnet).num_parameters()
