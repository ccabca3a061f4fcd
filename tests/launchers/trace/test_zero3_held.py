"""A frozen reference copy's own ZeRO-3 coordinator in the trace (launchers/trace/zero3_held.py): TRL's copy is an
engine of its own, so its modules' events are recorded beside the policy's and replayed apart, and what it holds joins
the policy's gathers and the activations at one moment. The figures below were measured on 2 CPU ranks (real
DeepSpeed 0.19.8, ``studies/grid-reference-llama-cpu.yaml``, z3 fp32 ckpt=none mbs=2, a hook after every
``LlamaMLP`` forward reading each parameter's ``ds_status``): after the copy's first MLP 62,464 elements were in flight
(the whole second block but its norms, and the head), after its second 16,384 (the head)."""

from __future__ import annotations

from pathlib import Path

import pytest

import launchers.trace.tracer as tracer
from launchers.trace.zero3_held import along
from launchers.trial.run import model_dict
from optimizer.deepspeed.zero3_gather import replay
from optimizer.deepspeed.zero_settings import gather_settings
from optimizer.study.knobs import Precision
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]
MEASURED_AFTER_MLP = [62_464, 16_384]  # elements the copy's coordinator held in flight after each MLP (module doc)


def test_values_stand_from_their_event_until_the_next_of_theirs():
    assert along([False, True, False, True, False], [5, 7]) == [0, 5, 5, 7, 7]
    assert along([False, False], []) == [0, 0]


def _traced(name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, tracer.TraceResult]:
    seen: dict = {}
    real = tracer.zero3_gathered

    def spy(model, modules, tracker, model_spec, reference=None):
        seen.update(modules=modules, tracker=tracker, spec=model_spec, reference=reference)
        return real(model, modules, tracker, model_spec, reference=reference)

    monkeypatch.setattr(tracer, "zero3_gathered", spy)
    study = load_study(ROOT / "studies" / f"{name}.yaml")
    result = tracer.trace(model_spec=model_dict(study.model), checkpointing="none", precision=Precision.FP32,
                          micro_batch=2, sequence_length=study.training.sequence_length)
    assert isinstance(result, tracer.TraceResult)
    return seen, result


def test_the_copys_events_replayed_apart_hold_what_deepspeed_held(monkeypatch):
    seen, result = _traced("grid-reference-llama-cpu", monkeypatch)
    count, reference = len(seen["modules"]), seen["reference"]
    theirs = [(kind, m - count) for kind, m in seen["tracker"].module_events if m >= count]
    assert theirs and all(kind.startswith("forward") for kind, _ in theirs)  # no_grad: no backward through it
    modules = list(reference.modules())
    params = list(reference.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    held = replay(events=theirs, module_params=[[index[id(p)] for p in m.parameters(recurse=False)] for m in modules],
                  param_numel=[p.numel() for p in params], settings=gather_settings(int(seen["spec"]["hidden_size"])))
    after_mlp = [h for (kind, m), h in zip(theirs, held, strict=True)
                 if kind == "forward_post" and type(modules[m]).__name__ == "LlamaMLP"]
    assert after_mlp == MEASURED_AFTER_MLP
    # the moment everything together peaked falls in the copy's forward, where it holds far more than one prefetch
    # bucket and its largest module (4 · (3,686 + 16,384) bytes: the formula used before)
    assert result.zero3_reference_joint[4] > 4 * (3_686 + 16_384)
    # the five parts at one moment: at least what the model's own stretches peaked at
    assert sum(result.zero3_reference_joint) >= max(map(sum, result.zero3_joint_segments))


def test_with_peft_the_reference_is_the_policy_so_no_coordinator_of_its_own(monkeypatch):
    seen, result = _traced("grid-reference-lora-llama-cpu", monkeypatch)
    assert all(m < len(seen["modules"]) for _, m in seen["tracker"].module_events)
    assert result.zero3_reference_joint == ()


@pytest.mark.slow  # two shallow traces and a full one
def test_a_trace_extended_from_shallow_copies_books_no_reference_joint():
    # the copy's hold does not extend on a line (launchers/trace/trace_depth.py): the ledger keeps the formula there
    from launchers.trace.study_traces import TraceCache

    study = load_study(ROOT / "studies" / "grid-reference-llama-cpu.yaml")
    spec = {**model_dict(study.model), "layers": 6}
    spec["hf_config"] = {**spec["hf_config"], "num_hidden_layers": 6}
    kwargs = {"checkpointing": "none", "precision": Precision.FP32, "micro_batch": 2, "sequence_length": 64}
    full = tracer.trace(model_spec=spec, **kwargs)
    extended = TraceCache(None).trace_model(model_spec=spec, parameters=full.parameters, **kwargs)
    assert full.zero3_reference_joint and extended.notes[-1].startswith("traced at depths")
    assert extended.zero3_reference_joint == ()
