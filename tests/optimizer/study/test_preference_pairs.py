"""Preference training as TRL runs it (issue 36, ``examples/trl_dpo``): ``training.sequences_per_sample`` (a DPO pair's
chosen and rejected completions, stacked into one batch of 2 × micro-batch rows) and ``model.lm_head: trl_fused``
(TRL's fused head: log-probabilities in tiles, no logits) are checked before work, reach what the ranks and the
tracer build, and count in the trace, the formula, the step's work, dsopt's own batches and the script hook's check."""

from __future__ import annotations

import pytest
import torch

from launchers.rank.script_checks import batch_mismatch
from optimizer.perf.throughput import work
from optimizer.study.errors import UserError
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import (
    ActivationSource,
    HardwareSpec,
    TrainingSpec,
    TransformerModel,
    baseline_candidate,
)
from optimizer.study.study_file import load_study
from tests.tiny_llama_study import LLAMA, llama_study


def test_both_keys_reach_what_the_ranks_build_and_are_absent_by_default(tmp_path):
    from launchers.trial.run import model_dict

    study = load_study(llama_study(tmp_path, training_extra={"sequences_per_sample": 2},
                              model_extra={"lm_head": "trl_fused"}))
    assert study.model.sequences_per_sample == 2 and study.model.rows(3) == 6
    assert model_dict(study.model)["sequences_per_sample"] == 2 and model_dict(study.model)["lm_head"] == "trl_fused"
    plain = model_dict(load_study(llama_study(tmp_path)).model)
    assert "sequences_per_sample" not in plain and "lm_head" not in plain  # every cache key as before


def test_the_models_own_head_may_be_named_on_any_transformer(tmp_path):
    shaped = {"kind": "transformer", "layers": 2, "hidden_size": 32, "heads": 2, "vocab_size": 64, "lm_head": "logits"}
    assert load_study(llama_study(tmp_path, model=shaped)).model.lm_head == "logits"


@pytest.mark.parametrize(("training_extra", "model_extra", "model", "key"), [
    ({"sequences_per_sample": 0}, None, None, "training.sequences_per_sample"),
    ({"sequences_per_sample": "two"}, None, None, "training.sequences_per_sample"),
    ({"sequences_per_sample": 1.5}, None, None, "training.sequences_per_sample"),
    ({"sequences_per_sample": 2}, None, {"kind": "seed", "parameters": 1000, "activation_bytes": {"none": "1 MB"}},
     "training.sequences_per_sample"),
    (None, {"lm_head": "fused"}, None, "model.lm_head"),
    (None, None, {"kind": "transformer", "layers": 2, "hidden_size": 32, "heads": 2, "vocab_size": 64,
                  "lm_head": "trl_fused"}, "model.lm_head"),
])
def test_a_bad_value_is_refused_by_its_key(tmp_path, training_extra, model_extra, model, key):
    with pytest.raises(UserError) as err:
        load_study(llama_study(tmp_path, training_extra=training_extra, model_extra=model_extra, model=model))
    assert err.value.key == key


def _model(**extra: object) -> TransformerModel:
    return TransformerModel(layers=2, hidden_size=32, heads=2, kv_heads=2, ffn_size=64, vocab_size=64,
                            max_positions=16, activations=ActivationSource.FORMULA, **extra)


def _work(model: TransformerModel, **knobs: object):
    training = TrainingSpec(global_batch_size=8, micro_batch_size=2, sequence_length=16)
    candidate = with_knobs(baseline_candidate(training), {"micro_batch_size": 2, **knobs})
    return work(candidate=candidate, model=model, hardware=HardwareSpec(gpus_per_node=2, gpu_memory_bytes=10**9),
                training=training)


def test_the_export_says_the_rows_and_the_head_it_was_planned_for(tmp_path):
    from optimizer.results.export import planned_setup

    text = planned_setup(load_study(llama_study(tmp_path, training_extra={"sequences_per_sample": 2,
                                                                     "reference_model": True},
                                           model_extra={"lm_head": "trl_fused"})))
    assert "2 sequences per sample" in text and "TRL's fused LM head" in text and "prepare_deepspeed" in text
    assert "sequences per sample" not in planned_setup(load_study(llama_study(tmp_path)))


def test_a_pair_runs_twice_the_tokens_and_a_reference_adds_one_forward_and_at_zero3_one_gather():
    plain, pairs = _work(_model()), _work(_model(sequences_per_sample=2))
    assert pairs.tokens == 2 * plain.tokens == 2 * 8 * 16 // 2 and pairs.flops == 2 * plain.flops
    assert pairs.comm_bytes == plain.comm_bytes  # the gradients do not grow with the rows
    forward = plain.flops / plain.tokens / 3  # a full fine-tune trains 3 forwards per token
    referenced = _work(_model(reference_model=True))
    assert referenced.flops == plain.flops + plain.tokens * forward
    z3, z3_ref = _work(_model(), zero_stage=3), _work(_model(reference_model=True), zero_stage=3)
    # ZeRO-3 gathers every parameter in forward and backward and once more for the reference's forward: per
    # micro-step (W−1)/W·b·(3Ψ + Ψtr) instead of (2Ψ + Ψtr), here Ψtr = Ψ
    assert z3_ref.comm_bytes_z3 / z3.comm_bytes_z3 == pytest.approx(4 / 3)
    off, off_ref = (_work(_model(**extra), zero_stage=3, offload_param="cpu") for extra in ({},
                                                                                            {"reference_model": True}))
    assert off_ref.pcie_bytes == pytest.approx(off.pcie_bytes * 3 / 2)


def test_the_formula_counts_the_rows_of_a_pair():
    from optimizer.ledger.activations import activation_items
    from optimizer.study.knobs import Candidate, NoCheckpointing, OffloadDevice, Precision, ZeroStage

    def total(model: TransformerModel, micro: int) -> int:
        candidate = Candidate(zero_stage=ZeroStage.DISABLED, offload_optimizer=OffloadDevice.NONE,
                              offload_param=OffloadDevice.NONE, precision=Precision.FP32,
                              checkpointing=NoCheckpointing(), micro_batch_size=micro)
        return sum(i.bytes for i in activation_items(model=model, candidate=candidate, sequence_length=16,
                                                     element_bytes=4))

    assert total(_model(sequences_per_sample=2), 2) == total(_model(), 4)


def test_dsopt_stacks_a_micro_batch_as_trls_collator_every_first_row_then_every_second():
    from launchers.rank.trial_rank import _step_batches

    seen: list[list[int]] = []

    def batch_fn(step: int, rows: list[int]) -> torch.Tensor:
        seen.append(rows)
        return torch.tensor(rows)

    _step_batches(batch_fn, step=0, rank=1, micro=2, accumulation=2, device=torch.device("cpu"), sequences=2)
    # rank 1's samples are 4-7; sample i's rows are 2i (chosen) and 2i + 1 (rejected)
    assert seen == [[8, 10, 9, 11], [12, 14, 13, 15]]
    seen.clear()
    _step_batches(batch_fn, step=0, rank=1, micro=2, accumulation=2, device=torch.device("cpu"))
    assert seen == [[4, 5], [6, 7]]  # one row per sample: the samples, as before


def test_the_hook_expects_the_rows_of_the_candidates_pairs_and_hints_at_the_key():
    pairs = {"expect": {"micro_batch_size": 2, "rows_per_micro_batch": 4}}
    assert batch_mismatch(pairs, 4) is None and batch_mismatch(pairs, None) is None
    assert "the candidate's is 2 samples of 2 sequences each: 4 rows, the script fed its engine batches of 2 rows" \
        in batch_mismatch(pairs, 2)
    single = {"expect": {"micro_batch_size": 2}}  # a plan written before the key: one row per sample
    assert batch_mismatch(single, 2) is None
    assert "Set training.sequences_per_sample" in batch_mismatch(single, 4)
    assert "sequences_per_sample" not in batch_mismatch(single, 3)


def test_trls_fused_head_is_traced_with_trls_own_tile_instead_of_the_logits():
    pytest.importorskip("trl")
    pytest.importorskip("transformers")
    from launchers.trace.tracer import trace
    from optimizer.study.knobs import Precision

    spec = {"hf_config": LLAMA, "attention": "eager", "vocab_size": LLAMA["vocab_size"],
            "hidden_size": LLAMA["hidden_size"]}
    kwargs = {"checkpointing": "none", "precision": Precision.FP32, "micro_batch": 2, "sequence_length": 32}
    logits = trace(model_spec=spec, **kwargs)
    fused = trace(model_spec={**spec, "lm_head": "trl_fused"}, **kwargs)
    pairs = trace(model_spec={**spec, "lm_head": "trl_fused", "sequences_per_sample": 2}, **kwargs)
    assert not any(hasattr(t, "why") for t in (logits, fused, pairs)), (logits, fused, pairs)
    # ChunkedLogProbFunction's tile: [min(N, 4096), 32768] fp32 for N = 2·31 scored positions (TRL shifts the labels
    # inside the head: 32 inputs score 31), whatever the vocabulary (256 here); the logits path never holds one
    tile = 2 * 31 * 32768 * 4
    assert tile <= fused.activation_peak_bytes < tile * 1.2 and tile > logits.activation_peak_bytes
    assert 2 * tile <= pairs.activation_peak_bytes < 2 * tile * 1.2  # a pair's rows: twice the positions


def test_a_trial_outside_the_space_is_traced_too(tmp_path):
    # `dsopt trial --set checkpointing=full` on a space of none only planned the candidate with the formula (5.3 MB
    # for the DPO example's 39.0 MB run): the space's traces and the candidate's are needed
    from launchers.trace.study_traces import needed_traces
    from optimizer.study.knobs import Precision, parse_checkpointing

    study = load_study(llama_study(tmp_path))
    outside = with_knobs(baseline_candidate(study.training), {"checkpointing": "full", "micro_batch_size": 4})
    space = needed_traces(study)
    assert ("full", Precision.FP32, False) not in space
    both = needed_traces(study, also=[outside])
    assert both[("full", Precision.FP32, False)] == (4,)
    assert {k: v for k, v in both.items() if k[0] != "full"} == space
    assert parse_checkpointing("full") == outside.checkpointing
