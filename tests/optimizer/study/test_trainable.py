"""What trains (issue 36): ``model.peft`` and ``training.frozen`` are checked before any work, the inventory counts the
trainable and frozen tensors as PEFT itself does, and a target or a glob that matches nothing is one error."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from optimizer.study.errors import UserError
from optimizer.study.peft_section import frozen_by, parse_frozen, parse_peft
from optimizer.study.study_file import load_study
from tests.tiny_llama_study import LLAMA, llama_study

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from launchers.trace.inventory import with_inventory  # noqa: E402
from optimizer.cli import main  # noqa: E402

FAMILIES = {name: entry["config"] for name, entry in
            json.loads((Path(__file__).parents[2] / "data" / "hf_families.json").read_text()).items()}




def test_an_inline_lora_setup_becomes_canonical_json_with_yaml_11_numbers_read_as_numbers(tmp_path):
    text = parse_peft({"r": 16, "lora_alpha": 32, "lora_dropout": "1e-1", "target_modules": ["v_proj", "q_proj"]},
                      source="s.yaml", key="model.peft", study_dir=tmp_path)
    assert json.loads(text) == {"peft_type": "LORA", "r": 16, "lora_alpha": 32.0, "lora_dropout": 0.1,
                                "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize(("fields", "key", "why"), [
    ({"r": 8, "target_modules": ["q_proj"], "lora_rank": 4}, "model.peft.lora_rank", "unknown LoraConfig field"),
    ({"r": 8}, "model.peft.target_modules", "required"),
    ({"r": 0, "target_modules": ["q_proj"]}, "model.peft.r", "positive whole number"),
    ({"r": 8, "lora_dropout": 1.5, "target_modules": ["q_proj"]}, "model.peft.lora_dropout", "[0, 1)"),
    ({"r": 8, "bias": "some", "target_modules": ["q_proj"]}, "model.peft.bias", "none, all, lora_only"),
    ({"peft_type": "IA3", "target_modules": ["q_proj"]}, "model.peft.peft_type", "LoRA"),
    ({"r": 8, "target_modules": ["q_proj"], "init_lora_weights": "pissa"}, "model.peft.init_lora_weights",
     "real base weights"),
    ({"r": 8, "target_modules": ["q_proj"], "modules_to_save": "all-linear"}, "model.peft.modules_to_save",
     "target_modules only"),
])
def test_a_lora_field_dsopt_cannot_plan_is_refused_by_its_key(tmp_path, fields, key, why):
    with pytest.raises(UserError) as caught:
        parse_peft(fields, source="s.yaml", key="model.peft", study_dir=tmp_path)
    assert caught.value.key == key and why in caught.value.why, caught.value


def test_a_saved_adapter_config_is_read_with_its_bookkeeping_ignored_and_an_unplanned_field_refused(tmp_path):
    saved = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    saved.save_pretrained(str(tmp_path))  # what PEFT writes beside a trained adapter
    fields = json.loads(parse_peft("adapter_config.json", source="s.yaml", key="model.peft", study_dir=tmp_path))
    assert fields["r"] == 4 and fields["target_modules"] == ["q_proj", "v_proj"] and fields["task_type"] == "CAUSAL_LM"
    data = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**data, "layer_replication": [[0, 2]]}))
    with pytest.raises(UserError) as caught:
        parse_peft("adapter_config.json", source="s.yaml", key="model.peft", study_dir=tmp_path)
    assert caught.value.source.endswith("adapter_config.json") and caught.value.key == "layer_replication"
    with pytest.raises(UserError, match="no such file"):
        parse_peft("missing.json", source="s.yaml", key="model.peft", study_dir=tmp_path)


def test_frozen_globs_are_fnmatch_patterns_of_whole_names():
    patterns = parse_frozen(["model.embed_tokens.*", "model.layers.[0-1].*"])
    assert frozen_by(patterns, "model.embed_tokens.weight") and frozen_by(patterns, "model.layers.1.mlp.up_proj.weight")
    assert not frozen_by(patterns, "model.layers.12.mlp.up_proj.weight") and not frozen_by(patterns, "lm_head.weight")
    for bad in ([], [""], 3, [1]):
        with pytest.raises(ValueError):
            parse_frozen(bad)


def test_a_seed_model_cannot_say_what_trains(tmp_path):
    raw = {"model": {"kind": "seed", "parameters": 1000, "activation_bytes": {"none": "1 GB"},
                     "peft": {"r": 8, "target_modules": ["q"]}},
           "hardware": {"gpus_per_node": 2, "gpu_memory": "24 GB"},
           "training": {"global_batch_size": 8, "micro_batch_size": 2, "sequence_length": 32},
           "search_space": {"knobs": {"zero_stage": [0]}}}
    path = tmp_path / "seed.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError) as caught:
        load_study(path)
    assert caught.value.key == "model.peft" and "seed-mode" in caught.value.why


def _peft_counts(config: dict, lora: dict) -> tuple[int, int]:
    """PEFT's own (trainable, all) of the real model — built independently of dsopt's code."""
    settings = dict(config)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(settings.pop("model_type"),
                                                                                            **settings))
    return peft.get_peft_model(model, peft.LoraConfig(**lora)).get_nb_trainable_parameters()


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "gemma", "phi3", "mixtral", "opt"])
def test_the_inventory_counts_what_trains_as_peft_does(tmp_path, family):
    config = LLAMA if family == "llama" else FAMILIES[family]
    lora = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    study = with_inventory(load_study(llama_study(tmp_path, model_extra={"peft": lora}, config=config)))
    inventory = study.model.inventory
    trainable, total = _peft_counts(config, lora)
    assert (inventory.trainable_parameters, inventory.parameters) == (trainable, total)
    assert 0 < inventory.trainable_parameters < inventory.parameters


@pytest.mark.parametrize(("family", "dora"), [("llama", True), ("gpt2", False), ("qwen2", False), ("opt", True)])
def test_the_inventory_marks_the_tensors_peft_keeps_in_fp32_in_a_bf16_model(tmp_path, family, dora):
    """What ``get_peft_model`` upcasts in a bf16 model (its default ``autocast_adapter_dtype``) — read off PEFT's own
    result, independently of dsopt's walk — is what the inventory marks ``adapter``: a ZeRO-3 run keeps it fp32."""
    config = LLAMA if family == "llama" else FAMILIES[family]
    lora = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "use_dora": dora}
    study = with_inventory(load_study(llama_study(tmp_path, model_extra={"peft": lora}, config=config)))
    marked = [t.numel for t in study.model.inventory.tensors if t.adapter]
    settings = dict(config)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(settings.pop("model_type"), **settings), dtype=torch.bfloat16)
    upcast = [p.numel() for p in peft.get_peft_model(model, peft.LoraConfig(**lora)).parameters()
              if p.dtype == torch.float32]
    assert sorted(marked) == sorted(upcast) and marked
    assert all(t.trainable for t in study.model.inventory.tensors if t.adapter)


def test_frozen_globs_leave_exactly_the_unmatched_parameters_trainable(tmp_path):
    frozen = ["model.embed_tokens.*", "model.layers.0.*"]
    study = with_inventory(load_study(llama_study(tmp_path, training_extra={"frozen": frozen})))
    inventory = study.model.inventory
    settings = dict(LLAMA)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(settings.pop("model_type"),
                                                                                            **settings))
    expected = sum(p.numel() for n, p in model.named_parameters()
                   if not (n.startswith("model.embed_tokens.") or n.startswith("model.layers.0.")))
    assert inventory.trainable_parameters == expected and inventory.frozen_parameters > 0
    assert not any(t.trainable for t in inventory.tensors if t.name.startswith("model.layers.0."))


@pytest.mark.parametrize(("model_extra", "training_extra", "key", "needle"), [
    ({"peft": {"r": 4, "target_modules": ["c_attn"]}}, {}, "model.peft.target_modules", "q_proj"),
    ({}, {"frozen": ["model.embed.*"]}, "training.frozen", "matches no parameter"),
    ({}, {"frozen": ["*"]}, "training.frozen", "no parameter of the model trains"),
])
def test_a_setup_that_does_not_fit_the_model_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, model_extra,
                                                                                     training_extra, key, needle):
    path = llama_study(tmp_path, model_extra=model_extra, training_extra=training_extra)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["ledger", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0] and needle in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_ledger_json_says_what_trains(tmp_path, capsys):
    path = llama_study(tmp_path, model_extra={"peft": {"r": 4, "target_modules": ["q_proj", "v_proj"]}})
    assert main(["ledger", str(path), "--json"]) == 0
    inventory = json.loads(capsys.readouterr().out)["inventory"]
    trainable, total = _peft_counts(LLAMA, {"r": 4, "target_modules": ["q_proj", "v_proj"]})
    assert (inventory["trainable"], inventory["frozen"], inventory["parameters"]) == (trainable, total - trainable,
                                                                                      total)


@pytest.mark.parametrize(("family", "lora", "trains_beside"), [
    ("llama", {"r": 4, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]},
     "lm_head.modules_to_save"),
    ("qwen2", {"r": 4, "target_modules": ["q_proj", "v_proj"], "bias": "lora_only"}, "q_proj.base_layer.bias"),
    ("llama", {"r": 4, "target_modules": ["q_proj", "v_proj"], "bias": "all"}, None),  # no biases in the model
    ("qwen2", {"r": 4, "target_modules": ["q_proj", "v_proj"]}, None),
])
def test_fp32_adapters_beside_16_bit_trainable_parameters_are_refused_at_zero3_only(tmp_path, family, lora,
                                                                                     trains_beside):
    """DeepSpeed's ZeRO-3 holds every trainable partition in one flat buffer of one dtype (runtime/zero/utils.py:218;
    the real failure: tests/real/deepspeed/test_mixed_trainable_dtypes_real.py): PEFT's fp32 adapters beside a
    ``modules_to_save`` copy in bf16 cannot train there, and can everywhere the dtypes agree."""
    from optimizer.study.constraints import invalid_reasons
    from optimizer.study.knobs import with_knobs
    from optimizer.study.specs import ModelInit, baseline_candidate

    config = LLAMA if family == "llama" else FAMILIES[family]
    study = with_inventory(load_study(llama_study(tmp_path, model_extra={"peft": lora}, config=config)))

    def why(training=study.training, **knobs):
        candidate = with_knobs(baseline_candidate(training), knobs)
        return invalid_reasons(candidate=candidate, model=study.model, hardware=study.hardware, training=training)

    refused = why(zero_stage=3, precision="bf16")
    if trains_beside is None:
        assert refused == ()
        return
    assert len(refused) == 1 and trains_beside in refused[0] and "runtime/zero/utils.py:218" in refused[0], refused
    offloaded = why(zero_stage=3, precision="bf16", offload_param="cpu", offload_optimizer="cpu")
    assert len(offloaded) == 1 and "at the first forward" in offloaded[0] and trains_beside in offloaded[0]
    blind = dataclasses.replace(study.model, inventory=None)  # the model could not be built: the setup decides
    z3_bf16 = with_knobs(baseline_candidate(study.training), {"zero_stage": 3, "precision": "bf16"})
    unbuilt = invalid_reasons(candidate=z3_bf16, model=blind, hardware=study.hardware, training=study.training)
    assert len(unbuilt) == 1 and ("modules_to_save copies" in unbuilt[0] or "biases it trains" in unbuilt[0])
    for fine in ({"zero_stage": 3}, {"zero_stage": 2, "precision": "bf16"}, {"zero_stage": 0, "precision": "bf16"}):
        assert why(**fine) == (), fine
    cast = dataclasses.replace(study.training, model_init=ModelInit.FULL)  # the engine casts a model it did not build
    assert why(training=cast, zero_stage=3, precision="bf16") == ()
