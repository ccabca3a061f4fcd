"""A study's traces: each (checkpointing, precision, micro-batch) its ledgers need, traced once on fake tensors
(:mod:`launchers.trace.tracer`; deep models from two shallow copies, :mod:`launchers.trace.trace_depth`), cached
by content in dsopt's cache folder (:mod:`launchers.trace.cache_dir`), and filled into its model spec as the ledger's
activation figures.

One cache entry is the whole model's trace (or its failure) at one (checkpointing, precision, micro-batch), under
the key :func:`trace_key`: the model as the ranks build it, the sequence length, the parameter count the shallow
copies are checked against, the torch (and, for models built by code, transformers) version, the source of dsopt's
tracing code and of an entry point's module. Nothing in it names the study or where it sits, so a copied or moved
study, or another study of the same model, reads the same entries. Reading them imports neither torch nor
transformers — the ledger's figures are taken off the stored JSON — so a warm ``dsopt ledger`` stays light; a
missing entry imports the tracer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launchers.process.collector import default_thresholds
from launchers.trace.cache_dir import cache_dir, source_digest
from launchers.trace.json_cache import KeyedJsonStore
from optimizer.deepspeed.versions import installed_version, installed_versions
from optimizer.study.constraints import invalid_reasons, zero3_keeps_adapters_fp32
from optimizer.study.knobs import Candidate, Precision, parse_checkpointing, with_knobs
from optimizer.study.specs import Accelerator, TransformerModel, baseline_candidate
from optimizer.study.study_file import StudySpec
from optimizer.study.traced_activation import ADAPTERS_CAST, CPU_KERNELS, ZERO3_RUN, TracedActivation

if TYPE_CHECKING:
    from launchers.trace.tracer import TraceFailure, TraceResult

TRACE_CODE = ("launchers.trace.tracer", "launchers.trace.trace_depth", "launchers.models.builtin",
              "launchers.models.four_bit", "launchers.models.blocks",
              "launchers.models.construction", "launchers.models.hf_model", "launchers.models.fake_kernels",
              "optimizer.deepspeed.zero3_gather", "optimizer.deepspeed.zero_settings", "launchers.models.trainable",
              "launchers.models.zero3_linear", "launchers.models.reference",
              "launchers.trace.zero3_events", "launchers.trace.zero3_held", "launchers.trace.cpu_kernels")
"""dsopt's modules that make a whole-model trace (the tracer, the depth extension, the models it builds, the
ZeRO-3 replay): their source is in every key, so an edit of any of them traces again."""
ENTRY_FORMAT = 3
"""Bumped when a cache entry's layout (``{"ok", "result"}``) changes (2: ``zero3_joint_segments`` of four; 3:
``zero3_reference_joint``)."""
_RESULT_FIELDS = ("parameters", "activation_peak_bytes", "peak_phase", "stored_bytes", "blocks_stored_bytes",
                  "joint_segments", "ungraded_segments", "graded_segments", "notes", "zero3_gathered_elements",
                  "zero3_joint_segments")
"""What a stored trace must hold to be used (the ledger's figures and :func:`trace_rows`' columns)."""


def trace_key(*, model_spec: Mapping[str, Any], checkpointing: str, precision: Precision, micro_batch: int,
              sequence_length: int, parameters: int | None, code: Mapping[str, str | int | None]) -> str:
    """The cache key of one whole-model trace: everything that determines it (module doc), as canonical JSON.
    ``parameters``: the full model's trainable count (what a trace counts: the tensors that require a gradient) the
    shallow copies must extend to (None: traced at full depth) — a model frozen by layer, whose copies do not
    extend to it, is traced whole;
    ``code``: :meth:`TraceCache.code` (library versions, dsopt's tracing source, the entry point's source)."""
    return json.dumps({"model": dict(model_spec), "checkpointing": checkpointing, "precision": str(precision),
                       "micro_batch": micro_batch, "sequence_length": sequence_length, "parameters": parameters,
                       "code": dict(code)}, sort_keys=True, separators=(",", ":"))


def _usable(entry: Any) -> bool:
    """A stored entry of this layout (an older or hand-edited one is traced again, and so is a failure of the
    machine that a dsopt before the transient rule stored: :meth:`TraceCache.entry` no longer stores one)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("result"), dict):
        return False
    fields = _RESULT_FIELDS if entry.get("ok") is True else ("op", "message") if entry.get("ok") is False else None
    return fields is not None and all(name in entry["result"] for name in fields) \
        and not entry["result"].get("transient", False)


def _typed(entry: dict[str, Any]) -> TraceResult | TraceFailure:
    """The :class:`launchers.trace.tracer.TraceResult` (or failure) of a stored entry."""
    from launchers.trace.tracer import TraceFailure, TraceResult

    kind = TraceResult if entry["ok"] else TraceFailure
    return kind(**{name: _frozen(value) for name, value in entry["result"].items()})


def _frozen(value: Any) -> Any:
    """A JSON value as the frozen dataclasses hold it: every list a tuple, at any depth (JSON has no tuples)."""
    if isinstance(value, list):
        return tuple(_frozen(item) for item in value)
    if isinstance(value, dict):
        return {key: _frozen(item) for key, item in value.items()}
    return value


def _found(result: TraceResult | TraceFailure) -> dict[str, Any]:
    """A trace as :class:`TraceCache` stores it: ``{"ok": bool, "result": its fields}``."""
    from launchers.trace.tracer import TraceResult

    return {"ok": isinstance(result, TraceResult), "result": asdict(result)}


def _joint_peak(segments: Sequence[Sequence[int]]) -> tuple[int, int]:
    """:func:`launchers.trace.tracer.joint_peak` of stored segments, without importing the tracer (and torch)."""
    best = max(segments, key=sum, default=(0, 0))
    return int(best[0]), int(best[1])


class TraceCache:
    """Whole-model traces, one file per key in ``folder`` (:class:`launchers.trace.json_cache.KeyedJsonStore`; None:
    kept in this instance only). Each new trace is written at once, so an interrupted study keeps what it
    traced; failures are cached too, with their reason. ``study_folder``: where an entry point's module sits
    (put first on the import path to find, hash and trace it, as trials put it on their PYTHONPATH)."""

    def __init__(self, folder: Path | None, *, study_folder: Path | None = None) -> None:
        self.store = KeyedJsonStore(folder)
        self.study_folder = study_folder
        self._code: dict[tuple[str | None, bool], dict[str, str | int | None]] = {}

    @classmethod
    def shared(cls, *, study_folder: Path | None = None) -> TraceCache:
        """The cache in dsopt's cache folder: ``cache_dir()/traces``."""
        return cls(cache_dir() / "traces", study_folder=study_folder)

    @property
    def folder(self) -> Path | None:
        return self.store.folder

    def code(self, model_spec: Mapping[str, Any]) -> dict[str, str | int | None]:
        """The code a trace of ``model_spec`` runs, for its key: torch's version, transformers' for a model built by
        code (``hf_config``, ``entry_point``), the source of :data:`TRACE_CODE` and of the entry point's module."""
        entry_point = model_spec.get("entry_point")
        which = (entry_point, bool(model_spec.get("peft")))
        if which not in self._code:
            versions = installed_versions()  # importlib.metadata: nothing is imported
            code: dict[str, str | int | None] = {"torch": versions["torch"], "format": ENTRY_FORMAT,
                                                 "dsopt_trace_code": source_digest(TRACE_CODE)}
            if model_spec.get("hf_config") or entry_point:
                code["transformers"] = versions["transformers"]
            if model_spec.get("peft"):
                code["peft"] = installed_version("peft")
            if entry_point:
                code["entry_point_source"] = source_digest([str(entry_point).partition(":")[0]],
                                                           folder=self.study_folder)
            self._code[which] = code
        return self._code[which]

    def key(self, *, model_spec: Mapping[str, Any], parameters: int | None, checkpointing: str,
            precision: Precision, micro_batch: int, sequence_length: int) -> str:
        """:func:`trace_key` of these arguments."""
        return trace_key(model_spec=model_spec, checkpointing=checkpointing, precision=precision,
                         micro_batch=micro_batch, sequence_length=sequence_length, parameters=parameters,
                         code=self.code(model_spec))

    def holds(self, **kwargs: Any) -> bool:
        """:meth:`entry` of these arguments is cached (reading it will not trace)."""
        return _usable(self.store.get(self.key(**kwargs)))

    def entry(self, *, model_spec: dict[str, Any], parameters: int | None, checkpointing: str, precision: Precision,
              micro_batch: int, sequence_length: int) -> dict[str, Any]:
        """The stored trace of the whole model, ``{"ok": bool, "result": TraceResult or TraceFailure as a dict}``:
        from the cache, else traced now — from two shallow copies where they extend to ``parameters``
        (:func:`launchers.trace.trace_depth.trace_by_depth`), else at full depth — and stored. A failure is stored under
        the key of its cause (the model, torch/transformers versions, dsopt's tracing source: an upgrade or an edit
        traces again); one of the machine (:attr:`launchers.trace.tracer.TraceFailure.transient`) is not stored."""
        kwargs = {"checkpointing": checkpointing, "precision": precision, "micro_batch": micro_batch,
                  "sequence_length": sequence_length}
        key = self.key(model_spec=model_spec, parameters=parameters, **kwargs)
        found = self.store.get(key)
        if _usable(found):
            return found
        from launchers.trace.inventory import importable_from
        from launchers.trace.trace_depth import trace_by_depth
        from launchers.trace.tracer import trace

        with importable_from(self.study_folder), default_thresholds():  # a trace measures liveness as a run does
            result = trace_by_depth(lambda spec: trace(model_spec=spec, **kwargs), model_spec=model_spec,
                                    checkpointing=checkpointing, parameters=parameters)
        found = _found(result)
        self.keep(key, found)
        return found

    def keep(self, key: str, found: dict[str, Any]) -> None:
        """Store an :meth:`entry` under ``key``, but a failure of the machine (not the model's: traced again)."""
        if found["ok"] or not found["result"].get("transient"):
            self.store.put(key, found)

    def trace_model(self, **kwargs: Any) -> TraceResult | TraceFailure:
        """:meth:`entry` as a :class:`launchers.trace.tracer.TraceResult` or
        :class:`launchers.trace.tracer.TraceFailure`."""
        return _typed(self.entry(**kwargs))


def cached_trace(*, cache: TraceCache | None, model_spec: dict[str, Any], checkpointing: str, precision: Precision,
                 micro_batch: int, sequence_length: int) -> TraceResult | TraceFailure:
    """:func:`launchers.trace.tracer.trace` of the model at its full depth, cached in ``cache`` (None: not stored)."""
    store = cache if cache is not None else TraceCache(None)
    return store.trace_model(model_spec=model_spec, parameters=None, checkpointing=checkpointing,
                             precision=precision, micro_batch=micro_batch, sequence_length=sequence_length)


def traced_activation(*, cache: TraceCache | None, model_spec: dict[str, Any], checkpointing: str,
                      precision: Precision, sequence_length: int, micro_batches: tuple[int, ...],
                      parameters: int | None = None) -> TracedActivation:
    """The ledger's entry: the whole model's trace at each of ``micro_batches``
    (:class:`optimizer.study.traced_activation.TracedActivation`), from shallow copies of the model when they
    extend to its ``parameters`` (:meth:`TraceCache.entry`); ``cache`` None: not stored."""
    store = cache if cache is not None else TraceCache(None)
    points, joints, splits, phase, notes, zero3, zero3_joints = [], [], [], "backward", (), 0, []
    autograd_held = 0
    for micro_batch in sorted(set(micro_batches)):
        entry = store.entry(model_spec=model_spec, parameters=parameters, checkpointing=checkpointing,
                            precision=precision, micro_batch=micro_batch, sequence_length=sequence_length)
        result = entry["result"]
        if not entry["ok"]:
            return TracedActivation(checkpointing=checkpointing, precision=precision, failed_op=result["op"],
                                    zero3_run=bool(model_spec.get(ZERO3_RUN)))
        points.append((micro_batch, result["activation_peak_bytes"]))
        joints.append((micro_batch, *_joint_peak(result["joint_segments"])))
        splits.append((micro_batch, max(result["ungraded_segments"], default=0),
                       max(result["graded_segments"], default=0)))
        phase, notes = result["peak_phase"], tuple(result["notes"])
        zero3 = max(zero3, result["zero3_gathered_elements"])
        autograd_held = max(autograd_held, int(result.get("zero3_autograd_held_bytes", 0)))
        if result["zero3_joint_segments"]:  # (activations, gathered, buffered, autograd's copies) where they peaked
            working, gathered, buffered, copies, reference = result.get("zero3_reference_joint") or (
                *max(result["zero3_joint_segments"], key=sum), 0)  # with a reference copy's gathers: all five
            zero3_joints.append((micro_batch, int(working), int(gathered + buffered), int(copies), int(reference)))
    return TracedActivation(checkpointing=checkpointing, precision=precision, points=tuple(points), peak_phase=phase,
                            joint_points=tuple(joints), split_points=tuple(splits), notes=notes,
                            zero3_gathered=zero3, zero3_autograd_held=autograd_held,
                            zero3_joint_points=tuple(zero3_joints) if len(zero3_joints) == len(points) else (),
                            zero3_run=bool(model_spec.get(ZERO3_RUN)))


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity: a SLURM or container allotment), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform (macOS)
        return max(1, os.cpu_count() or 1)


def fill(cache: TraceCache, jobs: Sequence[dict[str, Any]], *, workers: int | None = None) -> None:
    """Trace ``jobs`` (:meth:`TraceCache.entry` arguments) into ``cache``, as :meth:`TraceCache.entry` would one
    by one, but side by side on up to ``workers`` CPUs (default :func:`usable_cpus`): every single trace — each
    of a deep model's two shallow copies, or the model whole — is one item of
    :func:`launchers.trace.forked.shared_map` (this process and forked copies of it, none of them importing
    anything again). A model whose copies do not extend to its parameter count is traced whole in a second
    round, as :func:`launchers.trace.trace_depth.trace_by_depth` does."""
    if not jobs:
        return
    from launchers.trace.forked import shared_map
    from launchers.trace.inventory import importable_from
    from launchers.trace.trace_depth import from_copies, shallow_specs
    from launchers.trace.tracer import trace

    count = workers or usable_cpus()
    plans = [shallow_specs(job["model_spec"], job["checkpointing"], job["parameters"]) for job in jobs]

    def traced(item: tuple[int, dict[str, Any]]) -> TraceResult | TraceFailure:
        index, spec = item
        job = jobs[index]
        return trace(model_spec=spec, checkpointing=job["checkpointing"], precision=job["precision"],
                     micro_batch=job["micro_batch"], sequence_length=job["sequence_length"])

    with importable_from(cache.study_folder), default_thresholds():  # a trace measures liveness as a run does
        items = [(index, spec) for index, plan in enumerate(plans)
                 for spec in (plan[1] if plan else [jobs[index]["model_spec"]])]
        results = iter(shared_map(traced, items, workers=count))
        wholes = [next(results) if plan is None else
                  from_copies(next(results), next(results), depths=plan[0],
                              layers=int(jobs[index]["model_spec"]["layers"]), parameters=jobs[index]["parameters"])
                  for index, plan in enumerate(plans)]
        again = [index for index, whole in enumerate(wholes) if whole is None]
        if again:
            for index, whole in zip(again, shared_map(traced, [(i, jobs[i]["model_spec"]) for i in again],
                                                      workers=count), strict=True):
                wholes[index] = whole
    for job, whole in zip(jobs, wholes, strict=True):
        cache.keep(cache.key(**job), _found(whole))


def traceable_options(study: StudySpec) -> list[tuple[str, Precision]]:
    """(checkpointing, precision) pairs a trial could run: the study's space and its FP32 baseline, less what
    :func:`optimizer.study.constraints.invalid_reasons` refuses (an unsupported precision, selective recompute of a
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


def needed_traces(study: StudySpec, *, candidates: Sequence[Candidate] | None = None,
                  also: Sequence[Candidate] = ()) -> dict[tuple[str, Precision, bool], tuple[int, ...]]:
    """The micro-batches to trace per (checkpointing, precision, ZeRO-3 run): with ``candidates``, those the valid
    ones use (an invalid candidate has no ledger); else every micro-batch of the space for each
    :func:`traceable_options` pair — and what the candidates in ``also`` use (one ``--set`` outside the space). The
    third part is true only for the ZeRO-3 candidates of a model that trains in part
    (:data:`optimizer.study.traced_activation.ZERO3_RUN`): a full fine-tune's table is as it was."""
    adapted = isinstance(study.model, TransformerModel) and study.model.zero3_traced_apart
    needed: dict[tuple[str, Precision, bool], set[int]] = {}
    if candidates is None:
        micro_batches = traced_micro_batches(study)
        stages = {int(s) for s in dict(study.search_space.values).get("zero_stage", ())}
        runs = [False, True] if adapted and 3 in stages else [False]
        needed = {(*option, zero3): set(micro_batches) for option in traceable_options(study) for zero3 in runs}
    for candidate in [*(candidates or ()), *also]:
        if not invalid_reasons(candidate=candidate, model=study.model, hardware=study.hardware,
                               training=study.training):
            option = (str(candidate.checkpointing), candidate.precision, adapted and candidate.zero_stage == 3)
            needed.setdefault(option, set()).add(candidate.micro_batch_size)
    return {option: tuple(sorted(batches)) for option, batches in needed.items()}


def with_traced_activations(study: StudySpec, *, candidates: Sequence[Candidate] | None = None,
                            also: Sequence[Candidate] = (), warn: Callable[[str], None] | None = None) -> StudySpec:
    """The study with its model's ``traced_activations`` filled when it asks for ``activations: trace`` or
    ``auto`` (the default), cached in dsopt's cache folder (:class:`TraceCache`). With ``candidates`` only what
    they need is traced (:func:`needed_traces`: one (checkpointing, precision, micro-batch) for one ``--set``),
    and the table holds nothing else — the ledger of each of them equals its ledger from the whole space's table;
    without, the whole search space; ``also`` adds what its candidates need. Each failed trace is reported through
    ``warn`` (default: one line on stderr) naming the op, and the ledger uses the formula there. Other studies come
    back as they are.
    """
    from launchers.trial.run import model_dict
    from optimizer.ledger.transformer import trainable_count

    model = study.model
    if not isinstance(model, TransformerModel) or not model.wants_trace or model.traced_activations:
        return study
    if model.adapted and model.inventory is None:  # which tensors train is read off the built model only
        from launchers.trace.inventory import with_inventory

        study = with_inventory(study)
        model = study.model
    say = warn or (lambda line: print(line, file=sys.stderr))
    spec = model_dict(model)
    if study.hardware.accelerator is Accelerator.CPU:  # CPU ranks: the CPU kernels' temporaries too
        spec = {**spec, CPU_KERNELS: True}
    cache = TraceCache.shared(study_folder=study.path.parent.resolve())
    needed = needed_traces(study, candidates=candidates, also=also)
    parameters = trainable_count(model)  # what a trace counts (requires_grad), so the shallow copies extend to it
    seq = study.training.sequence_length
    cast = not zero3_keeps_adapters_fp32(model=model, training=study.training)
    specs = {False: spec, True: {**spec, ZERO3_RUN: True, **({ADAPTERS_CAST: True} if cast else {})}}
    jobs = [job for (c, p, zero3), batches in needed.items() for b in batches
            for job in [{"model_spec": specs[zero3], "parameters": parameters, "checkpointing": c, "precision": p,
                         "micro_batch": b, "sequence_length": seq}] if not cache.holds(**job)]
    if jobs:
        say(f"dsopt: tracing the model on fake tensors: {len(jobs)} (checkpointing, precision, micro-batch) "
            f"combinations, seconds each; cached in {cache.folder}")
        fill(cache, jobs)
    table = []
    for (checkpointing, precision, zero3), batches in needed.items():
        entry = traced_activation(cache=cache, model_spec=specs[zero3], checkpointing=checkpointing,
                                  precision=precision, sequence_length=seq, micro_batches=batches,
                                  parameters=parameters)
        if entry.failed_op is not None:
            say(f"warning: {study.path}: model.activations: {model.activations}: trace failed for "
                f"checkpointing={checkpointing} precision={precision} at {entry.failed_op}; the ledger uses the "
                "formula there (`dsopt trace` shows the error)")
        table.append(entry)
    return dataclasses.replace(study, model=dataclasses.replace(model, traced_activations=tuple(table)))


def trace_rows(*, study: StudySpec, cache: TraceCache | Path | None = None) -> list[dict[str, Any]]:
    """One row per (checkpointing, precision) of the study's space at its baseline micro-batch: the trace
    beside the formula, split into what the blocks keep and what is kept outside them (embeddings, final
    norm, logits, loss). ``cache``: None (or a path, the per-study ``traces.json`` of before the shared cache
    folder, which callers still passing one mean) — the shared cache (:meth:`TraceCache.shared`)."""
    from launchers.trial.run import model_dict
    from optimizer.ledger.transformer import activation_estimate, head_terms, trainable_count

    model = study.model
    spec = model_dict(model)
    mbs, seq = study.training.micro_batch_size, study.training.sequence_length
    store = cache if isinstance(cache, TraceCache) else TraceCache.shared(study_folder=study.path.parent.resolve())
    rows = []
    for checkpointing, precision in traceable_options(study):
        size = 4 if precision is Precision.FP32 else 2
        formula = activation_estimate(model, checkpointing=parse_checkpointing(checkpointing), seq=seq,
                                      micro_batch=model.rows(mbs), element_bytes=size)
        head = sum(t.bytes for t in head_terms(model, seq=seq, micro_batch=model.rows(mbs), element_bytes=size))
        row: dict[str, Any] = {
            "checkpointing": checkpointing, "precision": str(precision), "micro_batch": mbs,
            "formula_bytes": formula.total_bytes, "formula_blocks_stored_bytes": formula.stored_bytes - head,
            "formula_outside_blocks_bytes": head, "formula_parameters": trainable_count(model)}
        entry = store.entry(model_spec=spec, parameters=trainable_count(model), checkpointing=checkpointing,
                            precision=precision, micro_batch=mbs, sequence_length=seq)
        result = entry["result"]
        if not entry["ok"]:
            row.update(source="formula (trace failed)", failure=dict(result))
        else:
            row.update(source="trace", **result,
                       outside_blocks_bytes=result["stored_bytes"] - result["blocks_stored_bytes"])
        rows.append(row)
    return rows
