"""A frozen reference model beside the trained one (issue 36, ``training.reference_model``): the key is checked
before work, the DeepSpeed config the reference gets is TRL's own ``prepare_deepspeed``'s, the ledger prices the copy
by hand as TRL holds it, and the traced step holds the reference's forward on top of the policy's activations."""

from __future__ import annotations

import json
import sys
import types

import pytest

from optimizer.ledger.model_states import transformer_items
from optimizer.study.errors import UserError
from optimizer.study.inventory import InventoryTensor, ParameterInventory
from optimizer.study.knobs import Candidate, NoCheckpointing, OffloadDevice, Precision, ZeroStage
from optimizer.study.specs import ActivationSource, HardwareSpec, TrainingSpec, TransformerModel
from optimizer.study.study_file import load_study
from tests.tiny_llama_study import llama_study


def test_the_key_is_a_boolean_on_the_model_spec_and_in_what_the_ranks_build(tmp_path):
    from launchers.trial.run import model_dict

    study = load_study(llama_study(tmp_path, training_extra={"reference_model": True}))
    assert study.model.reference_model and model_dict(study.model)["reference_model"] is True
    plain = load_study(llama_study(tmp_path, training_extra={}))
    assert "reference_model" not in model_dict(plain.model)  # a study without it: every cache key as before


@pytest.mark.parametrize(("training_extra", "model", "key"), [
    ({"reference_model": "yes please"}, None, "training.reference_model"),
    ({"reference_model": True}, {"kind": "seed", "parameters": 1000, "activation_bytes": {"none": "1 MB"}},
     "training.reference_model"),
])
def test_a_bad_reference_model_is_refused_by_its_key(tmp_path, training_extra, model, key):
    with pytest.raises(UserError) as err:
        load_study(llama_study(tmp_path, training_extra=training_extra, model=model))
    assert err.value.key == key


def _trl_prepare_deepspeed_config(config: dict) -> dict:
    """The config TRL's own ``prepare_deepspeed`` passes to ``deepspeed.initialize`` (captured, not run)."""
    from trl.models.utils import prepare_deepspeed

    seen: dict = {}

    class Engine:
        def eval(self) -> Engine:
            return self

    def initialize(*, model, config):
        seen.update(config)
        return Engine(), None, None, None

    fake = types.ModuleType("deepspeed")
    fake.initialize = initialize
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(
        deepspeed_plugin=types.SimpleNamespace(deepspeed_config=config)))
    model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=64))
    real = sys.modules.get("deepspeed")
    sys.modules["deepspeed"] = fake
    try:
        prepare_deepspeed(model, accelerator)
    finally:
        if real is not None:
            sys.modules["deepspeed"] = real
    return seen


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_reference_config_is_trls_own(stage):
    pytest.importorskip("trl")
    from launchers.models.reference import reference_config

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupLR", "params": {}},
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"},
                                    **({"offload_param": {"device": "cpu"}} if stage == 3 else {})}}
    trl = _trl_prepare_deepspeed_config(json.loads(json.dumps(config)))
    ours = reference_config(config)
    # TRL also sets dotted "zero_optimization.*" keys at the top level at ZeRO-3, which DeepSpeed does not read
    assert ours == {k: v for k, v in trl.items() if not k.startswith("zero_optimization.")}
    assert ours["zero_optimization"]["stage"] == (3 if stage == 3 else 0) and "optimizer" not in ours
    assert config["zero_optimization"]["offload_optimizer"]  # the training's own config is left alone


# Ψ = 1,500 (embedding 1,000, a base weight 400, LoRA A and B 40 each, a norm 20) on 2 ranks, as in
# tests/optimizer/ledger/test_model_state_trainable.py; with no PEFT every tensor trains.
TENSORS = [("embed_tokens", (50, 20)), ("layers.0.attn.q", (20, 20)), ("layers.0.attn.k", (2, 20)),
           ("layers.0.attn.v", (20, 2)), ("final_norm", (20,))]
INVENTORY = ParameterInventory(tensors=tuple(
    InventoryTensor(name=f"{m}.weight", module=m, module_type="Linear", shape=s, dtype="float32")
    for m, s in TENSORS), model_class="M")
MODEL = TransformerModel(layers=1, hidden_size=20, heads=2, kv_heads=2, ffn_size=80, vocab_size=50, max_positions=16,
                         activations=ActivationSource.FORMULA, inventory=INVENTORY, reference_model=True)
HARDWARE = HardwareSpec(gpus_per_node=2, gpu_memory_bytes=10**9)
TRAINING = TrainingSpec(global_batch_size=4, micro_batch_size=2, sequence_length=16)


def _reference(stage: int, precision: Precision, model: TransformerModel = MODEL,
               param: OffloadDevice = OffloadDevice.NONE) -> dict[str, int]:
    candidate = Candidate(zero_stage=ZeroStage(stage), offload_optimizer=OffloadDevice.NONE, offload_param=param,
                          precision=precision, checkpointing=NoCheckpointing(), micro_batch_size=2)
    items = transformer_items(candidate=candidate, model=model, hardware=HARDWARE, training=TRAINING)
    return {i.name: i.bytes for i in items if i.name.startswith("reference model")}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_below_zero3_the_reference_is_whole_on_every_rank_in_the_training_dtype(stage):
    assert _reference(stage, Precision.BF16) == {
        "reference model: bf16 parameters (frozen copy, ZeRO stage 0: whole on every rank)": 2 * 1500}
    assert sum(_reference(stage, Precision.FP32).values()) == 4 * 1500


FORMULA = "reference model: parameters gathered or in flight for its forward (its prefetch front, up to max_live)"


def test_at_zero3_the_reference_is_partitioned_and_gathered_for_its_forward():
    items = _reference(3, Precision.FP32)
    # Q = 500 + 200 + 20 + 20 + 10; the persistence threshold 10·h = 200 keeps k, v and the norm whole (K = 100);
    # untraced, its forward's prefetch front holds what it fetched until max_live stops it (optimizer/ledger/
    # reference.py): min(Ψ − K = 1,400, max_live 1e9 + the largest module 1,000) = 1,400
    assert items == {"reference model: fp32 parameter partition": 4 * 750,
                     "reference model: persistent parameters": 4 * 100,
                     FORMULA: 4 * 1400}
    offloaded = _reference(3, Precision.FP32, param=OffloadDevice.CPU)
    assert offloaded["reference model: fp32 parameter partition (pinned)"] == 4 * 750


def test_with_peft_there_is_no_copy():
    adapted = TransformerModel(**{**{f: getattr(MODEL, f) for f in MODEL.__dataclass_fields__},
                                  "peft": '{"peft_type":"LORA","r":2,"target_modules":["q"]}'})
    assert _reference(0, Precision.BF16, adapted) == {} and _reference(3, Precision.BF16, adapted) == {}
    assert _reference(0, Precision.BF16, TransformerModel(**{**{f: getattr(MODEL, f) for f in
                                                                MODEL.__dataclass_fields__},
                                                             "reference_model": False})) == {}


TINY = {"layers": 2, "hidden_size": 32, "heads": 2, "kv_heads": 2, "ffn_size": 64, "vocab_size": 512,
        "tied_embeddings": True, "attention": "eager", "mlp": "gelu", "norm": "layernorm", "bias": True,
        "position_embedding": "learned", "dropout": True, "max_positions": 32, "entry_point": None, "hf_config": None}


@pytest.mark.parametrize("peft_fields", [None, {"peft_type": "LORA", "r": 4, "target_modules": ["q", "v"]}])
def test_the_traced_step_holds_the_references_forward_on_top_of_the_policys_activations(peft_fields):
    from launchers.trace.tracer import trace
    from optimizer.study.knobs import Precision as P

    spec = {**TINY, **({"peft": peft_fields} if peft_fields else {})}
    plain = trace(model_spec=spec, checkpointing="none", precision=P.FP32, micro_batch=2, sequence_length=32)
    with_ref = trace(model_spec={**spec, "reference_model": True}, checkpointing="none", precision=P.FP32,
                     micro_batch=2, sequence_length=32)
    assert not hasattr(plain, "why") and not hasattr(with_ref, "why"), (plain, with_ref)
    assert with_ref.stored_bytes == plain.stored_bytes  # measured before the reference's forward
    # the reference's logits (b·s·V fp32 = 2·32·512·4 = 131,072 bytes) and its loss's log-softmax come on top of
    # what the policy keeps for backward; its forward saves nothing (no_grad)
    assert with_ref.activation_peak_bytes >= plain.stored_bytes + 2 * 32 * 512 * 4
    assert with_ref.activation_peak_bytes > plain.activation_peak_bytes


def test_the_export_says_which_setup_it_was_planned_for(tmp_path):
    from optimizer.results.export import planned_setup

    plain = load_study(llama_study(tmp_path, training_extra={}))
    assert planned_setup(plain) == "planned for: a full fine-tune (every parameter trains)"
    lora = load_study(llama_study(tmp_path, training_extra={"reference_model": True}, model={
        "kind": "transformer", "hf_config": "config.json", "attention": "eager",
        "peft": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}}))
    text = planned_setup(lora)
    assert "PEFT LoRA r=4, lora_alpha=8.0, target_modules=['q_proj', 'v_proj']" in text
    assert "the base with the adapters disabled" in text
    frozen = load_study(llama_study(tmp_path, training_extra={"frozen": ["model.embed_tokens.*"],
                                                              "reference_model": True}))
    assert "frozen parameters model.embed_tokens.*" in planned_setup(frozen) and "prepare_deepspeed" in \
        planned_setup(frozen)
