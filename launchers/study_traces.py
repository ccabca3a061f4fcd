"""A study's traces: each (checkpointing, precision, micro-batch) of its search space traced once, cached in
``studies/NAME/traces.json``, and filled into its model spec as the ledger's activation figures."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from launchers.json_cache import JsonFileCache
from launchers.trace import TraceFailure, TraceResult, joint_peak, trace, trace_key
from launchers.trace_depth import shallow_specs, trace_by_depth
from optimizer.ledger.constraints import invalid_reasons
from optimizer.study.knobs import Precision, parse_checkpointing, with_knobs
from optimizer.study.specs import TransformerModel, baseline_candidate
from optimizer.study.study_file import StudySpec
from optimizer.study.traced_activation import TracedActivation


class TraceCache(JsonFileCache):
    """``studies/NAME/traces.json``, read once; each new trace is written at once, so an interrupted study keeps
    what it traced. Failures are cached too, with their reason; an unreadable or older entry is traced again.
    Without a path nothing is stored."""

    def trace(self, **kwargs: Any) -> TraceResult | TraceFailure:
        """:func:`trace` with these arguments, from the cache when it holds them."""
        key = trace_key(**kwargs)
        entry = self.data.get(key)
        if entry is not None:
            try:
                if entry["ok"]:
                    result = entry["result"]
                    return TraceResult(**{**result, "notes": tuple(result["notes"]),
                                          "joint_segments": tuple(tuple(p) for p in result["joint_segments"]),
                                          "working_segments": tuple(result["working_segments"]),
                                          "ungraded_segments": tuple(result["ungraded_segments"]),
                                          "graded_segments": tuple(result["graded_segments"])})
                return TraceFailure(**entry["result"])
            except (TypeError, KeyError):  # written by an older format: trace again
                pass
        result = trace(**kwargs)
        self.store(key, {"ok": isinstance(result, TraceResult), "result": asdict(result)}, indent=1)
        return result

    def holds_model(self, *, model_spec: dict[str, Any], parameters: int | None, **kwargs: Any) -> bool:
        """Whatever :meth:`trace_model` would trace for these arguments is cached (the shallow copies', or the
        full model's)."""
        chosen = shallow_specs(model_spec, kwargs["checkpointing"], parameters)
        specs = chosen[1] if chosen is not None else [model_spec]
        return all(trace_key(model_spec=spec, **kwargs) in self for spec in specs)

    def trace_model(self, *, model_spec: dict[str, Any], parameters: int | None, **kwargs: Any
                    ) -> TraceResult | TraceFailure:
        """The trace of the whole model, from two shallow copies where they extend to its ``parameters``
        (:mod:`launchers.trace_depth`), else at full depth; each copy's trace cached as any other."""
        return trace_by_depth(lambda spec: self.trace(model_spec=spec, **kwargs), model_spec=model_spec,
                              checkpointing=kwargs["checkpointing"], parameters=parameters)


def cached_trace(*, cache: Path | None, model_spec: dict[str, Any], checkpointing: str, precision: Precision,
                 micro_batch: int, sequence_length: int) -> TraceResult | TraceFailure:
    """:func:`trace`, cached in the JSON file ``cache`` (:class:`TraceCache`); None: no cache."""
    return TraceCache(cache).trace(model_spec=model_spec, checkpointing=checkpointing, precision=precision,
                                   micro_batch=micro_batch, sequence_length=sequence_length)


def traced_activation(*, cache: TraceCache | Path | None, model_spec: dict[str, Any], checkpointing: str,
                      precision: Precision, sequence_length: int, micro_batches: tuple[int, ...],
                      parameters: int | None = None) -> TracedActivation:
    """The ledger's entry: a trace at each of ``micro_batches`` (:class:`optimizer.study.specs.TracedActivation`),
    from shallow copies of the model when they extend to its ``parameters`` (:meth:`TraceCache.trace_model`)."""
    store = cache if isinstance(cache, TraceCache) else TraceCache(cache)
    points, joints, splits, phase, notes, zero3 = [], [], [], "backward", (), 0
    for micro_batch in sorted(set(micro_batches)):
        result = store.trace_model(model_spec=model_spec, parameters=parameters, checkpointing=checkpointing,
                                   precision=precision, micro_batch=micro_batch, sequence_length=sequence_length)
        if isinstance(result, TraceFailure):
            return TracedActivation(checkpointing=checkpointing, precision=precision, failed_op=result.op)
        points.append((micro_batch, result.activation_peak_bytes))
        joints.append((micro_batch, *joint_peak(result.joint_segments)))
        splits.append((micro_batch, max(result.ungraded_segments, default=0), max(result.graded_segments, default=0)))
        phase, notes, zero3 = result.peak_phase, result.notes, max(zero3, result.zero3_gathered_elements)
    return TracedActivation(checkpointing=checkpointing, precision=precision, points=tuple(points), peak_phase=phase,
                            joint_points=tuple(joints), split_points=tuple(splits), notes=notes,
                            zero3_gathered=zero3)


def traceable_options(study: StudySpec) -> list[tuple[str, Precision]]:
    """(checkpointing, precision) pairs a trial could run: the study's space and its FP32 baseline, less what
    :func:`optimizer.ledger.constraints.invalid_reasons` refuses (an unsupported precision, selective recompute of a
    transformers model, every_K past the last block)."""
    values = dict(study.search_space.values)
    base = baseline_candidate(study.training)
    options = []
    for ckpt in dict.fromkeys(["none", *(str(c) for c in values.get("checkpointing", ()))]):
        for precision in dict.fromkeys([Precision.FP32, *(Precision(str(p)) for p in values.get("precision", ()))]):
            candidate = with_knobs(base, {"checkpointing": ckpt, "precision": str(precision)})
            if not invalid_reasons(candidate=candidate, model=study.model, hardware=study.hardware,
                                   training=study.training):
                options.append((str(candidate.checkpointing), precision))
    return options


def traced_micro_batches(study: StudySpec) -> tuple[int, ...]:
    """The micro-batches a trial could use: the space's and the study's baseline."""
    values = dict(study.search_space.values)
    return tuple(sorted({study.training.micro_batch_size, *(int(b) for b in values.get("micro_batch_size", ()))}))


def with_traced_activations(study: StudySpec, *, warn: Callable[[str], None] | None = None) -> StudySpec:
    """The study with its model's ``traced_activations`` filled when it asks for ``activations: trace`` or
    ``auto`` (the default; cached in ``studies/NAME/traces.json``); each failed trace is reported through
    ``warn`` (default: one line on stderr) naming the op, and the ledger uses the formula there. Other studies
    come back as they are.
    """
    from launchers.trial import model_dict
    from optimizer.ledger.transformer import parameter_count

    model = study.model
    if not isinstance(model, TransformerModel) or not model.wants_trace or model.traced_activations:
        return study
    say = warn or (lambda line: print(line, file=sys.stderr))
    spec = model_dict(model)
    cache = TraceCache(study.output_dir / "traces.json")
    micro_batches = traced_micro_batches(study)
    options = traceable_options(study)
    parameters = parameter_count(model)
    missing = sum(not cache.holds_model(model_spec=spec, parameters=parameters, checkpointing=c, precision=p,
                                        micro_batch=b, sequence_length=study.training.sequence_length)
                  for c, p in options for b in micro_batches)
    if missing:
        say(f"dsopt: tracing the model on fake tensors: {missing} (checkpointing, precision, micro-batch) "
            f"combinations, seconds each; cached in {cache.path}")
    table = []
    for checkpointing, precision in options:
        entry = traced_activation(cache=cache, model_spec=spec, checkpointing=checkpointing, precision=precision,
                                  sequence_length=study.training.sequence_length, micro_batches=micro_batches,
                                  parameters=parameters)
        if entry.failed_op is not None:
            say(f"warning: {study.path}: model.activations: {model.activations}: trace failed for "
                f"checkpointing={checkpointing} precision={precision} at {entry.failed_op}; the ledger uses the "
                "formula there (`dsopt trace` shows the error)")
        table.append(entry)
    return dataclasses.replace(study, model=dataclasses.replace(model, traced_activations=tuple(table)))


def trace_rows(*, study: StudySpec, cache: Path | None = None) -> list[dict[str, Any]]:
    """One row per (checkpointing, precision) of the study's space at its baseline micro-batch: the trace
    beside the formula, split into what the blocks keep and what is kept outside them (embeddings, final
    norm, logits, loss)."""
    from launchers.trial import model_dict
    from optimizer.ledger.transformer import activation_estimate, head_terms, parameter_count

    model = study.model
    spec = model_dict(model)
    mbs, seq = study.training.micro_batch_size, study.training.sequence_length
    store = TraceCache(cache)
    rows = []
    for checkpointing, precision in traceable_options(study):
        size = 4 if precision is Precision.FP32 else 2
        formula = activation_estimate(model, checkpointing=parse_checkpointing(checkpointing), seq=seq,
                                      micro_batch=mbs, element_bytes=size)
        head = sum(t.bytes for t in head_terms(model, seq=seq, micro_batch=mbs, element_bytes=size))
        row: dict[str, Any] = {
            "checkpointing": checkpointing, "precision": str(precision), "micro_batch": mbs,
            "formula_bytes": formula.total_bytes, "formula_blocks_stored_bytes": formula.stored_bytes - head,
            "formula_outside_blocks_bytes": head, "formula_parameters": parameter_count(model)}
        result = store.trace_model(model_spec=spec, parameters=parameter_count(model), checkpointing=checkpointing,
                                   precision=precision, micro_batch=mbs, sequence_length=seq)
        if isinstance(result, TraceFailure):
            row.update(source="formula (trace failed)", failure=asdict(result))
        else:
            row.update(source="trace", **asdict(result),
                       outside_blocks_bytes=result.stored_bytes - result.blocks_stored_bytes)
        rows.append(row)
    return rows
