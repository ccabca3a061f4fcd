"""The parameter inventory (optimizer/study/inventory.py, launchers/trace/inventory.py): taken from the model itself on
fake tensors, equal to the hand layout where the layout is right, and what the ledger counts where it is not."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import yaml

from launchers.models.builtin import GPT
from launchers.trace import inventory as inventory_module
from launchers.trace.inventory import inventory_of, take_inventory, with_inventory
from launchers.trial.run import model_dict
from optimizer.cli import main
from optimizer.ledger.core import compute_ledger
from optimizer.ledger.transformer import (
    largest_layer_parameters,
    largest_tensor_parameters,
    layout_tensors,
    parameter_count,
    persistent_parameters,
    zero3_partition_elements,
)
from optimizer.study.inventory import InventoryTensor, ParameterInventory
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import TransformerModel, baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]
SHAPES = {
    "gpt2 tied": dict(layers=2, hidden_size=64, heads=4, kv_heads=4, ffn_size=256, vocab_size=512),
    "gpt2 untied": dict(layers=2, hidden_size=64, heads=4, kv_heads=4, ffn_size=256, vocab_size=512,
                        tied_embeddings=False),
    "llama-like": dict(layers=3, hidden_size=64, heads=8, kv_heads=2, ffn_size=172, vocab_size=300,
                       tied_embeddings=False, mlp="swiglu", norm="rmsnorm", bias=False, position_embedding="rope",
                       dropout=False),
    "swiglu with biases": dict(layers=1, hidden_size=32, heads=2, kv_heads=1, ffn_size=96, vocab_size=128,
                               mlp="swiglu", norm="rmsnorm", bias=True),
}
CANDIDATES = ({"zero_stage": 0}, {"zero_stage": 1, "precision": "bf16"}, {"zero_stage": 2},
              {"zero_stage": 3, "precision": "bf16"}, {"zero_stage": 3, "offload_optimizer": "cpu",
                                                       "offload_param": "cpu"})


def _fake_inventory(model: TransformerModel) -> ParameterInventory:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        built = GPT(model_dict(model), checkpointing="none")
    return inventory_of(built, source="test")


@pytest.mark.parametrize("name", SHAPES)
def test_the_built_in_gpts_inventory_equals_the_hand_layout(name):
    model = TransformerModel(**SHAPES[name])
    inventory = _fake_inventory(model)
    real = GPT(model_dict(model), checkpointing="none")  # the same model built for real
    assert inventory.parameters == sum(p.numel() for p in real.parameters())
    with_inventory_model = dataclasses.replace(model, inventory=inventory)
    assert sorted(t.numel for t in inventory.tensors) == sorted(t.numel for t in layout_tensors(model))
    for ranks in (1, 2, 8):
        assert zero3_partition_elements(with_inventory_model, ranks=ranks) == zero3_partition_elements(model,
                                                                                                       ranks=ranks)
    assert parameter_count(with_inventory_model) == parameter_count(model)
    assert largest_layer_parameters(with_inventory_model) == largest_layer_parameters(model)
    assert largest_tensor_parameters(with_inventory_model) == largest_tensor_parameters(model)
    for threshold in (0, 64, 640, 10**6):
        assert persistent_parameters(with_inventory_model, threshold=threshold) == \
            persistent_parameters(model, threshold=threshold)
    assert inventory.tied == ()  # dsopt's GPT ties by reusing the embedding matrix in its head, not a module


@pytest.mark.parametrize("name", ["gpt2 tied", "llama-like"])
def test_the_ledger_is_the_same_from_the_inventory_and_from_the_layout(name):
    study = load_study(ROOT / "studies" / "cpu-tiny.yaml")
    model = TransformerModel(**SHAPES[name])
    counted = dataclasses.replace(model, inventory=_fake_inventory(model))
    for knobs in CANDIDATES:
        candidate = with_knobs(baseline_candidate(study.training), knobs)
        ledgers = [compute_ledger(candidate=candidate, model=m, hardware=study.hardware, training=study.training)
                   for m in (model, counted)]
        assert [(i.name, i.bytes, i.phase) for i in ledgers[0].items] == \
            [(i.name, i.bytes, i.phase) for i in ledgers[1].items], knobs


def _llama_config(**overrides):
    return json.loads((ROOT / "studies" / "llama-tiny-cpu.config.json").read_text()) | overrides


@pytest.mark.parametrize("tied", [False, True])
def test_a_transformers_llama_counts_what_num_parameters_counts(tied):
    transformers = pytest.importorskip("transformers")
    config = _llama_config(tie_word_embeddings=tied)
    spec = {"hf_config": config, "attention": "fused", "vocab_size": config["vocab_size"]}
    inventory = take_inventory(spec, sequence_length=16)
    settings = dict(config)
    real = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(settings.pop("model_type"),
                                                                                           **settings))
    assert inventory.parameters == real.num_parameters()
    assert inventory.model_class == type(real).__name__ == "LlamaForCausalLM"
    assert {t.name for t in inventory.tensors} <= {n for n, _ in real.named_parameters()}
    if tied:
        assert inventory.tied == (("model.embed_tokens.weight", "lm_head.weight"),)
    else:
        assert inventory.tied == ()
    # the transformers Llama is what the hand layout describes: the same counts from both
    study = load_study(ROOT / "studies" / "llama-tiny-cpu.yaml")
    shaped = dataclasses.replace(study.model, tied_embeddings=tied)
    assert inventory.parameters == parameter_count(shaped)
    assert inventory.largest_module()[1] == largest_layer_parameters(shaped)


def _entry_point_study(tmp_path: Path, *, entry_point: str, module: str = "extra_workload") -> Path:
    (tmp_path / f"{module}.py").write_text(
        "import torch\n"
        "from launchers.models.builtin import GPT, SyntheticTokens\n\n"
        "class WithAdapter(torch.nn.Module):  # a user's module the shape does not describe\n"
        "    def __init__(self, spec):\n"
        "        super().__init__()\n"
        "        self.inner = GPT(spec, checkpointing='none')\n"
        "        self.adapter = torch.nn.Linear(spec['hidden_size'], 1000)\n\n"
        "    def forward(self, tokens):\n"
        "        return self.inner(tokens)\n\n"
        "def workload(spec, sequence_length, seed, checkpointing):\n"
        "    return WithAdapter(spec), SyntheticTokens(vocab_size=spec['vocab_size'], sequence_length=sequence_length,"
        " seed=seed)\n\n"
        "def needs_values(spec, sequence_length, seed, checkpointing):\n"
        "    model = GPT(spec, checkpointing='none')\n"
        "    if float(next(model.parameters()).sum()) != 0.0:  # reads a value: impossible on fake tensors\n"
        "        pass\n"
        "    return model, None\n\n"
        "class TiedHead(torch.nn.Module):  # a user's own tie, by assignment\n"
        "    def __init__(self, spec):\n"
        "        super().__init__()\n"
        "        self.embed = torch.nn.Embedding(spec['vocab_size'], spec['hidden_size'])\n"
        "        self.head = torch.nn.Linear(spec['hidden_size'], spec['vocab_size'], bias=False)\n"
        "        self.head.weight = self.embed.weight\n\n"
        "def tied(spec, sequence_length, seed, checkpointing):\n"
        "    print('building the tied model')  # must not reach stdout: --json is there\n"
        "    return TiedHead(spec), SyntheticTokens(vocab_size=spec['vocab_size'], sequence_length=sequence_length,"
        " seed=seed)\n\n"
        "def bare(spec, sequence_length, seed, checkpointing):\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))\n")
    raw = yaml.safe_load((ROOT / "studies" / "cpu-tiny.yaml").read_text())
    raw["model"]["entry_point"] = entry_point
    raw["name"] = "inventory-entry"
    path = tmp_path / "inventory-entry.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _inventory_entries(folder: Path) -> list[Path]:
    """The inventory cache's entries in the cache folder ``folder`` (launchers/trace/cache_dir.py)."""
    return sorted((folder / "inventory").glob("*.json"))


@pytest.mark.slow  # seconds each: a real model trace / a whole study
def test_an_entry_points_own_modules_are_counted(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path / "cache"))
    study = load_study(_entry_point_study(tmp_path, entry_point="extra_workload:workload"))
    counted = with_inventory(study)
    inventory = counted.model.inventory
    assert inventory is not None and inventory.model_class == "WithAdapter"
    adapter = study.model.hidden_size * 1000 + 1000
    assert parameter_count(counted.model) == parameter_count(study.model) + adapter  # the layout misses it
    assert inventory.largest_module() == ("adapter", adapter)  # and ZeRO-3 gathers it whole
    assert len(_inventory_entries(tmp_path / "cache")) == 1  # in the cache folder, not beside the study
    assert not study.output_dir.exists()
    # dsopt ledger prints the inventory and counts from it
    assert main(["ledger", str(study.path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parameters"] == parameter_count(counted.model)
    assert out["inventory"]["model_class"] == "WithAdapter"
    assert out["inventory"]["largest_module"] == {"name": "adapter", "elements": adapter}
    assert main(["ledger", str(study.path), "--set", "precision=fp32"]) == 0  # one candidate's itemised ledger
    text = capsys.readouterr().out
    assert "meta-parameter build of entry point extra_workload:workload" in text
    assert f"largest module (ZeRO-3 gathers it whole): adapter — {adapter:,} elements" in text


def test_the_inventory_is_cached_per_model_and_versions(tmp_path, monkeypatch):
    study = load_study(_entry_point_study(tmp_path, entry_point="extra_workload:workload"))
    first = with_inventory(study).model.inventory

    def no_build(*args, **kwargs):
        raise AssertionError("built again although cached")

    monkeypatch.setattr(inventory_module, "take_inventory", no_build)
    assert with_inventory(study).model.inventory == first


def test_a_model_that_cannot_be_built_on_fake_tensors_keeps_the_layout_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path / "cache"))
    study = load_study(_entry_point_study(tmp_path, entry_point="extra_workload:needs_values"))
    said = []
    kept = with_inventory(study, warn=said.append)
    assert kept.model.inventory is None and parameter_count(kept.model) == parameter_count(study.model)
    assert len(said) == 1 and str(study.path) in said[0] and "shape's layout" in said[0]
    assert not _inventory_entries(tmp_path / "cache")  # a failure is not cached: fix the code, run again


def test_the_inventory_round_trips_and_compares_by_content():
    tensors = (InventoryTensor(name="a.weight", module="a", module_type="Linear", shape=(4, 3), dtype="float32"),
               InventoryTensor(name="b.weight", module="b", module_type="Embedding", shape=(10, 4), dtype="float32"))
    inventory = ParameterInventory(tensors=tensors, tied=(("b.weight", "c.weight"),), model_class="M", source="s")
    again = ParameterInventory.from_json(json.loads(json.dumps(inventory.to_json())))
    assert again == inventory and hash(again) == hash(inventory)
    assert inventory.parameters == 52 and inventory.largest_module() == ("b", 40)
    assert inventory.by_module_type() == [("Embedding", 1, 40), ("Linear", 1, 12)]
    with pytest.raises(ValueError):
        ParameterInventory.from_json({**inventory.to_json(), "format": 0})
    with pytest.raises(ValueError):
        ParameterInventory(tensors=())


def test_shape_only_studies_with_the_formula_keep_the_ledger_free_of_torch(tmp_path):
    # the inventory is taken only for models built by code the shape does not describe, and the trace (the
    # default, activations: auto) only when asked: a shape-only study with the formula never imports torch
    raw = yaml.safe_load((ROOT / "studies" / "cpu-tiny.yaml").read_text())
    raw["model"]["activations"] = "formula"
    path = tmp_path / "cpu-tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    code = (f"import sys; from optimizer.cli import main; rc = main(['ledger', {str(path)!r}]); "
            "sys.exit(rc or (3 if 'torch' in sys.modules else 0))")
    import subprocess

    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # 3: the plan was made, torch imported
    assert "cpu-tiny" in proc.stdout, proc.stdout[-2000:]  # the plan was printed, not an early error


def test_a_transformers_config_the_library_cannot_build_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path / "cache"))
    config = json.loads((ROOT / "studies" / "llama-tiny-cpu.config.json").read_text()) | {"pad_token_id": 4096}
    (tmp_path / "bad.config.json").write_text(json.dumps(config))  # a padding row past the vocabulary
    raw = yaml.safe_load((ROOT / "studies" / "llama-tiny-cpu.yaml").read_text())
    raw["model"]["hf_config"] = "bad.config.json"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["ledger", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert str(path) in captured.err and "model.hf_config" in captured.err and "cannot build" in captured.err
    assert not _inventory_entries(tmp_path / "cache")


@pytest.mark.slow  # seconds each: a real model trace / a whole study
def test_an_entry_points_own_tie_is_counted_once_and_its_prints_stay_off_stdout(tmp_path, capsys):
    study = load_study(_entry_point_study(tmp_path, entry_point="tied_workload:tied", module="tied_workload"))
    counted = with_inventory(study)
    vocab, hidden = study.model.vocab_size, study.model.hidden_size
    assert counted.model.inventory.parameters == vocab * hidden  # one tensor under two names
    assert counted.model.inventory.tied == (("embed.weight", "head.weight"),)
    assert main(["ledger", str(study.path), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["inventory"]["parameters"] == vocab * hidden  # stdout is the JSON alone
    assert "building the tied model" not in captured.out


@pytest.mark.parametrize(("entry_point", "needle"), [
    ("no_such_module_anywhere:workload", "cannot load"),
    ("broken_workload:no_such_function", "cannot load"),
    ("broken_workload:bare", "returns (model, batch_fn)"),  # [0] would have been its first Linear
])
def test_an_entry_point_its_trials_could_not_use_is_one_line_exit_2(tmp_path, capsys, entry_point, needle):
    path = _entry_point_study(tmp_path, entry_point=entry_point, module="broken_workload")
    assert main(["ledger", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert "model.entry_point" in captured.err and needle in captured.err


def test_an_edited_entry_point_is_counted_again(tmp_path):
    path = _entry_point_study(tmp_path, entry_point="edited_workload:workload", module="edited_workload")
    before = with_inventory(load_study(path)).model.inventory.parameters
    module = tmp_path / "edited_workload.py"
    module.write_text(module.read_text().replace("1000)", "5000)"))
    sys.modules.pop("edited_workload", None)
    after = with_inventory(load_study(path)).model.inventory.parameters
    hidden = load_study(path).model.hidden_size
    assert after - before == 4000 * (hidden + 1)
