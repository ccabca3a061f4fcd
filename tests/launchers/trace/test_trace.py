"""Traced activations on fake tensors (launchers/trace/tracer.py): the built-in GPT, a transformers Llama, a failing
model, the cache, and the traced figures in the ledger with their source named."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path

import pytest

from launchers.trace.study_traces import TraceCache, cached_trace, traced_activation, with_traced_activations
from launchers.trace.tracer import TraceFailure, TraceResult, trace
from launchers.trial.run import model_dict
from optimizer.cli import main
from optimizer.ledger.core import compute_ledger, evaluate
from optimizer.ledger.transformer import activation_estimate, head_terms, largest_layer_parameters, parameter_count
from optimizer.results.report import ledger_json
from optimizer.study.knobs import Precision, parse_checkpointing, with_knobs
from optimizer.study.specs import ActivationSource, MlpKind, NormKind, baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def study():
    return load_study(ROOT / "studies" / "gpt2-tiny-cpu.yaml")


@pytest.fixture(scope="module")
def llama():
    return load_study(ROOT / "studies" / "llama-tiny-cpu.yaml")


def _trace(model, *, checkpointing="none", precision=Precision.FP32, mbs=2, seq=64):
    return trace(model_spec=model_dict(model), checkpointing=checkpointing, precision=precision, micro_batch=mbs,
                 sequence_length=seq)


def test_parameters_and_largest_layer_match_the_ledger(study, llama):
    llama_like = replace(study.model, mlp=MlpKind.SWIGLU, norm=NormKind.RMSNORM, kv_heads=2, bias=False,
                         tied_embeddings=False)
    for model in (study.model, llama_like, llama.model):
        result = _trace(model)
        assert isinstance(result, TraceResult)
        assert result.parameters == parameter_count(model)
        assert result.largest_module_parameters == largest_layer_parameters(model)


def test_kept_activations_agree_with_the_formula_within_what_is_explained(study):
    # gpt2-tiny-cpu, 4 x 128 tokens, measured: kept when forward ends +14.4 % (fp32) and +7.8 % (bf16) over the
    # formula. The trace's own account by op says why (docs/ledger.md, "Traced activations"): CPU dropout keeps its mask
    # in the input's dtype (aten.empty_like) where the formula counts 1-byte masks, and eager attention's
    # matmuls keep contiguous copies of Q and Kᵀ (aten.clone).
    for precision, size in ((Precision.FP32, 4), (Precision.BF16, 2)):
        result = _trace(study.model, precision=precision, mbs=4, seq=128)
        formula = activation_estimate(study.model, checkpointing=parse_checkpointing("none"), seq=128, micro_batch=4,
                                      element_bytes=size)
        assert isinstance(result, TraceResult)
        assert formula.stored_bytes <= result.stored_bytes <= 1.2 * formula.stored_bytes
        assert abs(sum(result.kept_by_op.values()) - result.stored_bytes) <= 0.001 * result.stored_bytes
        masks = result.kept_by_op["aten.empty_like"]
        sbh, a = 4 * 128 * 128, 4
        per_layer_masks = 2 * sbh + a * 128 * 128 * 4  # residual dropouts + attention-probability dropout
        assert masks == size * (study.model.layers * per_layer_masks + sbh)  # + the embedding dropout


@pytest.mark.parametrize("checkpointing", ["none", "every_2", "selective", "full"])
@pytest.mark.parametrize(("precision", "size"), [(Precision.FP32, 4), (Precision.BF16, 2)])
def test_the_blocks_keep_what_the_formula_says_once_cpu_dropout_masks_are_counted(study, checkpointing, precision,
                                                                                   size):
    # Measured on gpt2-tiny-cpu, 4 x 128 tokens: what the blocks keep is the formula's figure plus the CPU's
    # wider dropout masks (size - 1 extra bytes per element: two residual masks, and the attention-probability
    # mask where the attention core is kept), to within 0.6 %; the rest is LayerNorm's mean and rstd. The
    # tolerance is 1 %. With full checkpointing the blocks keep exactly their inputs, L·p·sbh (Korthikanti §5).
    b, seq = 4, 128
    result = _trace(study.model, checkpointing=checkpointing, precision=precision, mbs=b, seq=seq)
    assert isinstance(result, TraceResult) and result.blocks == study.model.layers
    formula = activation_estimate(study.model, checkpointing=parse_checkpointing(checkpointing), seq=seq,
                                  micro_batch=b, element_bytes=size)
    head = sum(t.bytes for t in head_terms(study.model, seq=seq, micro_batch=b, element_bytes=size))
    sbh, as2b = seq * b * study.model.hidden_size, study.model.heads * seq * seq * b
    kept_layers = {"none": 2, "every_2": 1, "selective": 2, "full": 0}[checkpointing]
    wider_masks = (size - 1) * kept_layers * (2 * sbh + (0 if checkpointing == "selective" else as2b))
    expected = formula.stored_bytes - head + wider_masks
    assert abs(result.blocks_stored_bytes - expected) <= 0.01 * expected
    if checkpointing == "full":
        assert result.blocks_stored_bytes == study.model.layers * size * sbh
        assert result.stored_bytes - result.blocks_stored_bytes >= head  # the head keeps at least the formula's


def test_the_high_water_mark_is_in_backward_and_orders_the_granularities(study):
    results = {c: _trace(study.model, checkpointing=c) for c in ("none", "selective", "full")}
    logits_gradients = 2 * 4 * 64 * 2 * study.model.vocab_size  # FP32 s×b×V: d log-softmax and d logits
    for result in results.values():
        assert isinstance(result, TraceResult) and result.peak_phase == "backward"
        # on this vocabulary-heavy model the mark is the stored activations + the logits' two gradients
        assert abs(result.activation_peak_bytes - result.stored_bytes - logits_gradients) <= 0.01 * logits_gradients
        assert result.total_peak_bytes >= result.activation_peak_bytes
    peaks = {c: r.activation_peak_bytes for c, r in results.items()}
    assert peaks["full"] < peaks["selective"] < peaks["none"]


@pytest.mark.slow  # seconds each: a real model trace / a whole study
def test_every_micro_batch_of_the_space_is_traced(study, tmp_path):
    cache = TraceCache(tmp_path / "traces")
    entry = traced_activation(cache=cache, model_spec=model_dict(study.model), checkpointing="full",
                              precision=Precision.FP32, sequence_length=64, micro_batches=(1, 2, 4))
    assert [b for b, _ in entry.points] == [1, 2, 4]
    direct = _trace(study.model, checkpointing="full", mbs=4)
    assert entry.bytes_at(4) == direct.activation_peak_bytes
    assert entry.bytes_at(1) < entry.bytes_at(3) < entry.bytes_at(4)  # joined between traced points
    assert len(list((tmp_path / "traces").glob("*.json"))) == 3  # one file per micro-batch


def test_a_transformers_llama_differs_from_the_gpt_formula_as_its_architecture_says(llama):
    result = _trace(llama.model, precision=Precision.FP32, mbs=4, seq=128)
    assert isinstance(result, TraceResult)
    ops = result.kept_by_op
    assert "aten.gelu" not in ops and "aten.silu" in ops  # SwiGLU: SiLU's output is kept for the product
    assert "aten.empty_like" not in ops  # no dropout, no masks
    assert "aten.native_layer_norm" not in ops and "aten.rsqrt" in ops  # RMSNorm keeps x·rsqrt(mean x²)
    sbf = 4 * 128 * llama.model.ffn_size
    assert ops["aten.silu"] == 4 * llama.model.layers * sbf  # one fp32 s×b×f tensor per block


def test_an_untraceable_model_falls_back_with_the_op_named(study, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    untraceable = replace(study.model, entry_point="untraceable_workload:workload")
    result = _trace(untraceable)
    assert isinstance(result, TraceFailure) and "nonzero" in result.op
    cache = TraceCache(tmp_path / "traces")
    kwargs = {"model_spec": model_dict(untraceable), "checkpointing": "none", "precision": Precision.FP32,
              "micro_batch": 2, "sequence_length": 64}
    assert isinstance(cached_trace(cache=cache, **kwargs), TraceFailure)
    (stored,) = (tmp_path / "traces").glob("*.json")
    assert "nonzero" in stored.read_text()
    assert isinstance(cached_trace(cache=TraceCache(tmp_path / "traces"), **kwargs), TraceFailure)  # from the file


@pytest.mark.slow  # seconds each: a real model trace / a whole study
def test_a_failed_trace_warns_and_the_ledger_says_formula(study, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path / "cache"))  # cold: every combination is counted
    model = replace(study.model, entry_point="untraceable_workload:workload", activations=ActivationSource.TRACE)
    spec = dataclasses.replace(study, model=model, path=tmp_path / "s.yaml")
    warnings: list[str] = []
    traced = with_traced_activations(spec, warn=warnings.append)
    assert warnings[0].startswith("dsopt: tracing the model on fake tensors: 32 ")  # 4 granularities x 2 x 4
    failures = [w for w in warnings if w.startswith("warning:")]
    assert failures and all("aten.nonzero" in w and "formula" in w for w in failures)
    ledger = compute_ledger(candidate=baseline_candidate(spec.training), model=traced.model,
                            hardware=spec.hardware, training=spec.training)
    assert ledger_json(ledger)["activation_source"].startswith("formula (trace failed at aten.nonzero")


@pytest.mark.slow  # seconds each: a real model trace / a whole study
def test_the_ledger_takes_traced_activations_and_names_the_source(llama, tmp_path):
    traced = with_traced_activations(dataclasses.replace(llama, path=tmp_path / "llama-tiny-cpu.yaml"))
    formula_model = replace(llama.model, activations=ActivationSource.FORMULA)
    candidate = with_knobs(baseline_candidate(llama.training), {"precision": "bf16"})
    ledgers = {name: compute_ledger(candidate=candidate, model=model, hardware=llama.hardware,
                                    training=llama.training)
               for name, model in (("trace", traced.model), ("formula", formula_model))}
    assert ledger_json(ledgers["trace"])["activation_source"] == "trace"
    assert ledger_json(ledgers["formula"])["activation_source"] == "formula"
    direct = _trace(llama.model, precision=Precision.BF16, mbs=4, seq=128)
    activations = [i for i in ledgers["trace"].items if i.category.value == "activations"]
    assert [i.bytes for i in activations] == [direct.activation_peak_bytes]
    assert activations[0].source.startswith("trace: ")
    seed = load_study(ROOT / "studies" / "seed-1b-2x24gb.yaml")
    seed_ledger = compute_ledger(candidate=baseline_candidate(seed.training), model=seed.model,
                                 hardware=seed.hardware, training=seed.training)
    assert ledger_json(seed_ledger)["activation_source"] == "study"


def test_dsopt_trace_prints_trace_beside_formula(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path / "cache"))
    study_file = tmp_path / "t.yaml"
    study_file.write_text((ROOT / "studies" / "cpu-tiny.yaml").read_text().replace(
        "checkpointing: [none, full, every_2, selective]", "checkpointing: [none, full]"))
    assert main(["trace", str(study_file)]) == 0
    out = capsys.readouterr().out
    assert out.count("| none |") == 2 and out.count("| full |") == 2 and "backward" in out
    assert len(list((tmp_path / "cache" / "traces").glob("*.json"))) == 4  # (none, full) x (fp32, bf16)
    assert not (tmp_path / "cpu-tiny").exists()  # nothing beside the study


@pytest.mark.slow  # seconds each: a real model trace / a whole study
def test_dsopt_ledger_traces_when_the_study_asks(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("llama-tiny-cpu.yaml", "llama-tiny-cpu.config.json"):
        (tmp_path / name).write_text((ROOT / "studies" / name).read_text())
    assert main(["ledger", str(tmp_path / "llama-tiny-cpu.yaml"), "--all"]) == 0
    out = capsys.readouterr().out
    assert " trace " in out and "formula" not in out
    assert list((tmp_path / "cache" / "traces").glob("*.json"))
    assert not (tmp_path / "llama-tiny-cpu").exists()


@pytest.mark.slow  # seconds each: a real model trace / a whole study
def test_one_candidates_table_gives_the_ledger_the_whole_spaces_table_gives(llama, tmp_path, monkeypatch):
    # `dsopt ledger --set ...` traces only the candidate's (checkpointing, precision, micro-batch); its table then
    # holds one point where the whole space's holds every micro-batch: the ledger must not see the difference
    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path / "cache"))
    spec = dataclasses.replace(llama, path=tmp_path / "llama-tiny-cpu.yaml")
    candidates = list(spec.search_space.candidates(baseline_candidate(spec.training)))
    one = with_knobs(baseline_candidate(spec.training), {"checkpointing": "every_2", "precision": "bf16",
                                                         "micro_batch_size": 2})
    said: list[str] = []
    alone = with_traced_activations(spec, candidates=[one], warn=said.append)  # cold: one combination
    assert said == [f"dsopt: tracing the model on fake tensors: 1 (checkpointing, precision, micro-batch) "
                    f"combinations, seconds each; cached in {tmp_path / 'cache' / 'traces'}"]
    (table,) = alone.model.traced_activations
    assert (table.checkpointing, table.precision, [b for b, _ in table.points]) == ("every_2", Precision.BF16, [2])
    whole = with_traced_activations(spec, warn=said.append)
    assert len(said) == 2 and ": 17 (checkpointing" in said[1]  # 3 x 2 x 3 less the one already traced
    assert {b for t in whole.model.traced_activations for b, _ in t.points} == {1, 2, 4}
    checked = 0
    for candidate in candidates:
        alone = with_traced_activations(spec, candidates=[candidate], warn=said.append)  # warm: traces nothing
        verdicts = [evaluate(candidate=candidate, model=s.model, hardware=spec.hardware, training=spec.training)
                    for s in (alone, whole)]
        assert verdicts[0] == verdicts[1], candidate.label()
        checked += verdicts[0].ledger is not None
    assert len(said) == 2 and checked == len(candidates) == 36


def test_a_failure_of_the_machine_is_not_cached_and_is_traced_again(study, tmp_path, monkeypatch):
    import launchers.trace.tracer as tracer

    real = tracer.trace
    calls = []

    def flaky(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:  # the host ran out of memory while tracing: the machine's failure, not the model's
            return tracer._failure(MemoryError("cannot allocate"))
        return real(**kwargs)

    monkeypatch.setattr(tracer, "trace", flaky)
    kwargs = {"model_spec": model_dict(study.model), "checkpointing": "none", "precision": Precision.FP32,
              "micro_batch": 2, "sequence_length": 64}
    cache = TraceCache(tmp_path / "traces")
    first = cached_trace(cache=cache, **kwargs)
    assert isinstance(first, TraceFailure) and first.transient and first.op == "MemoryError"
    assert not list((tmp_path / "traces").glob("*.json"))  # nothing stored
    assert not isinstance(cached_trace(cache=TraceCache(tmp_path / "traces"), **kwargs), TraceFailure)
    assert len(calls) == 2 and len(list((tmp_path / "traces").glob("*.json"))) == 1


def test_a_machine_failure_an_older_dsopt_stored_is_traced_again(study, tmp_path):
    """Before the transient rule a failure of the machine was stored like any other; such an entry is not used."""
    kwargs = {"model_spec": model_dict(study.model), "checkpointing": "none", "precision": Precision.FP32,
              "micro_batch": 2, "sequence_length": 64}
    cache = TraceCache(tmp_path / "traces")
    stored = {"ok": False, "result": {"op": "MemoryError", "message": "cannot allocate", "transient": True}}
    cache.store.put(cache.key(parameters=None, **kwargs), stored)
    assert not cache.holds(parameters=None, **kwargs)
    assert not isinstance(cached_trace(cache=TraceCache(tmp_path / "traces"), **kwargs), TraceFailure)
    stored["result"]["transient"] = False  # the same entry, the model's own failure: used as it is
    cache.store.put(cache.key(parameters=None, **kwargs), stored)
    assert cache.holds(parameters=None, **kwargs)
    assert cached_trace(cache=cache, **kwargs) == TraceFailure(op="MemoryError", message="cannot allocate")


def test_a_stored_trace_reads_back_equal_to_the_traced_one(study, tmp_path):
    kwargs = {"model_spec": model_dict(study.model), "checkpointing": "full", "precision": Precision.BF16,
              "micro_batch": 1, "sequence_length": 64}
    traced = cached_trace(cache=TraceCache(tmp_path / "traces"), **kwargs)  # traced now, and stored
    assert cached_trace(cache=TraceCache(tmp_path / "traces"), **kwargs) == traced  # read from the JSON file
