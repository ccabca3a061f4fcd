"""A 4-bit QLoRA base (issue 36): ``model.quantization`` checked before any work, the layers transformers' own
bitsandbytes quantizer converts marked in the inventory (checked against a real ``from_pretrained`` quantization on
the CPU), and the ledger holding them at their real bytes — whole below ZeRO-3, partitioned as their packed storage
elements at ZeRO-3 — with the dequantized weight of one matmul beside the activations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from optimizer.ledger.four_bit_items import dequantized_weight_bytes
from optimizer.ledger.quantized import four_bit_bytes, packed_elements
from optimizer.study.errors import UserError
from optimizer.study.quantization_section import FourBitBase, parse_quantization

LLAMA = json.loads((Path(__file__).parents[3] / "examples" / "tiny-llama" / "config.json").read_text())
QLORA = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
         "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "bfloat16"}
LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"]}


def _study(tmp_path: Path, *, quantization: dict | None = None, knobs: dict | None = None, config: dict | None = None,
           training_extra: dict | None = None, model_extra: dict | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config or LLAMA))
    raw = {"name": "q", "model": {"kind": "transformer", "hf_config": "config.json", "attention": "eager",
                                  "quantization": quantization if quantization is not None else QLORA, "peft": LORA,
                                  **(model_extra or {})},
           "hardware": {"accelerator": "cpu", "gpus_per_node": 2, "gpu_memory": "1 GiB"},
           "training": {"global_batch_size": 8, "micro_batch_size": 2, "sequence_length": 32,
                        **(training_extra or {})},
           "search_space": {"knobs": knobs or {"zero_stage": [0, 2, 3], "precision": ["fp32", "bf16"]}}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_fields_become_canonical_json_with_bitsandbytes_defaults():
    base = FourBitBase.from_json(parse_quantization({"load_in_4bit": True, "bnb_4bit_compute_dtype": "torch.bfloat16",
                                                     "llm_int8_threshold": 6.0}, source="s", key="model.quantization"))
    # transformers' BitsAndBytesConfig defaults: fp4, no double quant, uint8 storage (utils/quantization_config.py)
    assert base == FourBitBase(quant_type="fp4", double_quant=False, compute_dtype="bfloat16", storage="uint8")
    assert base.label() == "4-bit fp4 (compute bfloat16)"


@pytest.mark.parametrize(("fields", "key", "why"), [
    ({"load_in_4bit": True, "bnb_4bit_quant_typ": "nf4"}, "model.quantization.bnb_4bit_quant_typ",
     "unknown BitsAndBytesConfig field"),
    ({"bnb_4bit_quant_type": "nf4"}, "model.quantization.load_in_4bit", "required"),
    ({"load_in_8bit": True}, "model.quantization.load_in_8bit", "not planned"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "model.quantization.bnb_4bit_quant_type", "fp4, nf4"),
    ({"load_in_4bit": True, "bnb_4bit_quant_storage": "int4"}, "model.quantization.bnb_4bit_quant_storage", "uint8"),
    ({"load_in_4bit": True, "bnb_4bit_compute_dtype": "float64"}, "model.quantization.bnb_4bit_compute_dtype",
     "bfloat16"),
    ({"load_in_4bit": "yes"}, "model.quantization.load_in_4bit", "must be true"),
    ({"load_in_4bit": True, "llm_int8_enable_fp32_cpu_offload": True},
     "model.quantization.llm_int8_enable_fp32_cpu_offload", "not planned"),
    ({"load_in_4bit": True, "quant_method": "gptq"}, "model.quantization.quant_method", "bitsandbytes"),
])
def test_a_field_dsopt_cannot_plan_is_refused_by_its_key(fields, key, why):
    with pytest.raises(UserError) as err:
        parse_quantization(fields, source="s.yaml", key="model.quantization")
    assert err.value.key == key and why in err.value.why, (err.value.key, err.value.why)


@pytest.mark.parametrize(("storage", "zero3", "dtype", "ok"), [
    ("uint8", False, "bfloat16", True), ("uint8", True, "bfloat16", False), ("bfloat16", True, "bfloat16", True),
    ("bfloat16", False, "bfloat16", True), ("float32", False, "bfloat16", False), ("bfloat16", False, "float32", True),
    ("bfloat16", True, "float32", False), ("float16", False, "bfloat16", False), ("float32", True, "float32", True),
])
def test_the_storage_dtype_rules(storage, zero3, dtype, ok):
    # ZeRO-3 partitions the packed weights as parameters; a 16-bit engine casts floating parameters (engine.py)
    problem = FourBitBase(storage=storage).storage_problem(zero3=zero3, training_dtype=dtype)
    assert (problem is None) is ok, problem


def test_per_candidate_storage_problems_are_invalid_reasons_and_a_space_of_none_is_exit_2(tmp_path, capsys):
    from optimizer.cli import main
    from optimizer.study.study_file import load_study

    study = load_study(_study(tmp_path))
    assert study.training.model_init.value == "device"  # transformers builds a quantized model without zero.Init
    from optimizer.study.constraints import invalid_reasons
    from optimizer.study.knobs import with_knobs
    from optimizer.study.specs import baseline_candidate
    z3_fp32 = with_knobs(baseline_candidate(study.training), {"zero_stage": 3, "precision": "fp32"})
    reasons = invalid_reasons(candidate=z3_fp32, model=study.model, hardware=study.hardware, training=study.training)
    assert any("bnb_4bit_quant_storage" in r for r in reasons), reasons
    path = _study(tmp_path, knobs={"zero_stage": [3], "precision": ["fp32"]})
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["ledger", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.quantization.bnb_4bit_quant_storage" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_without_bitsandbytes_every_candidate_is_invalid_with_the_reason_and_the_plan_still_prints(tmp_path, capsys,
                                                                                                   monkeypatch):
    from importlib import metadata

    from optimizer.cli import main

    real = metadata.version

    def version(name: str) -> str:
        if name == "bitsandbytes":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    assert main(["ledger", str(_study(tmp_path, knobs={"zero_stage": [0, 2], "precision": ["bf16"]}))]) == 0
    out = capsys.readouterr().out
    assert "2 invalid" in out and "2  model.quantization needs the bitsandbytes package" in out, out


@pytest.mark.parametrize(("model_extra", "training_extra", "key"), [
    ({}, {"model_init": "zero_init"}, "training.model_init"),
])
def test_a_quantized_model_is_never_built_under_zero_init(tmp_path, model_extra, training_extra, key):
    from optimizer.study.study_file import load_study

    with pytest.raises(UserError) as err:
        load_study(_study(tmp_path, knobs={"zero_stage": [3], "precision": ["bf16"]}, training_extra=training_extra,
                          model_extra=model_extra))
    assert err.value.key == key


def test_a_model_given_by_its_shape_cannot_be_quantized(tmp_path):
    from optimizer.study.study_file import load_study

    raw = {"model": {"kind": "transformer", "layers": 2, "hidden_size": 64, "heads": 4, "vocab_size": 256,
                     "quantization": QLORA},
           "hardware": {"accelerator": "cpu", "gpus_per_node": 2, "gpu_memory": "1 GiB"},
           "training": {"global_batch_size": 8, "micro_batch_size": 2, "sequence_length": 32},
           "search_space": {"knobs": {"zero_stage": [0]}}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError) as err:
        load_study(tmp_path / "s.yaml")
    assert err.value.key == "model.quantization" and "hf_config" in err.value.why


def _hand_model(compute: str = "bfloat16"):
    from optimizer.study.inventory import InventoryTensor, ParameterInventory
    from optimizer.study.specs import TransformerModel

    tensors = (InventoryTensor(name="w", module="m", module_type="Linear", shape=(128, 64), dtype="float32",
                               trainable=False, four_bit=True),
               InventoryTensor(name="a", module="m.a", module_type="Linear", shape=(4, 64), dtype="float32"))
    return TransformerModel(layers=1, hidden_size=64, heads=4, kv_heads=4, ffn_size=256, vocab_size=256,
                            hf_config="{}", inventory=ParameterInventory(tensors=tensors),
                            quantization=FourBitBase(compute_dtype=compute, double_quant=True).to_json())


def test_the_step_time_work_of_a_four_bit_base_by_hand():
    from optimizer.perf.four_bit_work import four_bit_work

    n = 128 * 64
    # bf16 compute, bf16 training, full recomputation, 100 tokens in 2 micro-steps: GEMMs stay at the 16-bit rate;
    # dequantized in forward twice (0.5 + 2 bytes per element) and in backward once (0.5 + 2)
    same = four_bit_work(model=_hand_model(), training_bytes=2, tokens=100, micro_steps=2, recomputed=1.0)
    assert (same.elements, same.packed_bytes, same.other_precision_flops) == (n, n // 2, 0.0)
    assert same.dequant_bytes == 2 * (2.5 * n * 2 + 2.5 * n)
    # transformers' default fp32 compute under bf16 training: forward, input-gradient and recomputed GEMMs at the
    # fp32 rate; backward dequantizes to bf16 and casts to fp32 (0.5 + 2 + 2 + 4)
    slow = four_bit_work(model=_hand_model("float32"), training_bytes=2, tokens=100, micro_steps=2, recomputed=1.0)
    assert slow.other_precision_flops == 100 * 2 * n * 3
    assert slow.dequant_bytes == 2 * (4.5 * n * 2 + 8.5 * n)


def test_the_dequantized_weight_by_hand():
    model = _hand_model()
    # forward: 2 bytes (bf16 compute) x 8,192 + the nested absmax in fp32 (128 blocks of 64); backward in fp32
    # training: dequantized to fp32 (the weight's dtype), then to the bf16 gradient: 4 + 2 bytes per element
    assert dequantized_weight_bytes(model, training_bytes=2) == (2 * 8192 + 4 * 128, "2·L₄ + 4·L₄/64")
    assert dequantized_weight_bytes(model, training_bytes=4) == (6 * 8192, "4·L₄ + 2·L₄")


bnb = pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")


def _real_quantization(tmp_path: Path, config: dict, fields: dict) -> tuple[dict[str, int], int]:
    """Each 4-bit weight's element count, by name, and the bytes of every Params4bit + its quant_state, as
    ``from_pretrained`` on the CPU makes them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    folder = tmp_path / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(**fields),
                                                 device_map={"": "cpu"})
    four_bit, held = {}, 0
    for name, param in model.named_parameters():
        if type(param).__name__ == "Params4bit":
            state = param.quant_state
            four_bit[name] = int(torch.Size(state.shape).numel())
            parts = [param, state.absmax, state.code] + ([state.state2.absmax, state.state2.code, state.offset]
                                                           if state.nested else [])
            held += sum(t.numel() * t.element_size() for t in parts)
    return four_bit, held


@pytest.mark.parametrize(("family", "extra"), [
    ("llama", {}),
    ("gpt2", {}),  # Conv1D layers, a tied head
    ("llama", {"llm_int8_skip_modules": ["o_proj"]}),  # given: transformers' own list (lm_head) is dropped
])
def test_the_inventory_marks_what_from_pretrained_quantizes_and_the_ledger_holds_its_bytes(tmp_path, family, extra):
    from launchers.trace.inventory import with_inventory
    from optimizer.ledger.transformer import four_bit_weights
    from optimizer.study.study_file import load_study

    families = json.loads((Path(__file__).parents[2] / "data" / "hf_families.json").read_text())
    config = LLAMA if family == "llama" else families[family]["config"]
    fields = {**QLORA, "bnb_4bit_quant_storage": "uint8", **extra}
    real, real_bytes = _real_quantization(tmp_path, config, fields)
    target = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}[family]
    study = with_inventory(load_study(_study(tmp_path, quantization=fields, config=config,
                                             model_extra={"peft": {"r": 4, "target_modules": target}})))
    inventory = study.model.inventory
    ours = {t.name.removeprefix("base_model.model.").replace(".base_layer", ""): t.numel
            for t in inventory.tensors if t.four_bit}
    assert ours == real
    assert not any(t.trainable for t in inventory.tensors if t.four_bit)
    assert four_bit_weights(study.model).held_bytes == real_bytes
    stats = sum(four_bit_bytes(n, double_quant=True).statistics for n in real.values())
    assert four_bit_weights(study.model).statistics_bytes == stats


def test_ledger_json_counts_the_four_bit_weights_as_peft_does(tmp_path, capsys):
    from optimizer.cli import main

    fields = {**QLORA, "bnb_4bit_quant_storage": "uint8"}
    real, _ = _real_quantization(tmp_path, LLAMA, fields)
    path = _study(tmp_path, quantization=fields, knobs={"zero_stage": [0, 2], "precision": ["bf16"]})
    assert main(["ledger", str(path), "--json"]) == 0
    inventory = json.loads(capsys.readouterr().out)["inventory"]
    assert inventory["four_bit"] == sum(real.values()) and inventory["four_bit_tensors"] == len(real)


def test_at_zero3_the_packed_weights_are_partitioned_as_storage_elements(tmp_path):
    from launchers.trace.inventory import with_inventory
    from optimizer.ledger.transformer import held_tensors, parameter_tensors, zero3_partition_elements
    from optimizer.study.study_file import load_study

    study = with_inventory(load_study(_study(tmp_path, knobs={"zero_stage": [3], "precision": ["bf16"]})))
    model = study.model
    full = parameter_tensors(model)
    held = held_tensors(model)
    assert any(t.four_bit for t in full)
    for whole, as_held in zip(full, held, strict=True):  # bf16 storage: ⌈n/2⌉ bytes are ⌈n/4⌉ bf16 elements
        assert as_held.numel == (packed_elements(whole.numel, storage_bytes=2) if whole.four_bit else whole.numel)
    assert zero3_partition_elements(model, ranks=2) == sum(-(-t.numel // 2) for t in held)


def test_the_export_says_which_four_bit_base_it_was_planned_for(tmp_path):
    from optimizer.results.export import planned_setup
    from optimizer.study.study_file import load_study

    text = planned_setup(load_study(_study(tmp_path)))
    assert "4-bit nf4 (double quant, bfloat16 storage, compute bfloat16) base" in text, text
    assert "bnb_4bit_quant_storage=torch.bfloat16" in text and "PEFT LoRA r=4" in text, text
