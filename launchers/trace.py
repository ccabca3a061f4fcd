"""Traced activations: the study's own model on fake tensors, one micro-batch forward + backward (issue 7).

PyTorch's ``FakeTensorMode`` runs the model without allocating memory (shapes, dtypes and devices only), and
``torch.distributed._tools.mem_tracker.MemTracker`` attributes every tensor it sees to parameters,
gradients, activations or temporaries and records the peak. So a 1B-parameter model traces in seconds on a
machine without a GPU. The model is the built-in GPT (:mod:`launchers.workload`) or the study's entry point,
built directly in the training dtype (bf16/fp16 as DeepSpeed casts it, fp32 otherwise).

A model that cannot be traced — a data-dependent shape, an op without a fake implementation — gives a
:class:`TraceFailure` naming the op, and callers fall back to the formula; tracing never crashes a study.
Results are cached per (model, shape, granularity, precision, torch version) in ``studies/NAME/traces.json``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from launchers.workload import GPT, build_workload
from optimizer.knobs import Precision

DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceResult:
    """What one traced micro-batch needed (bytes per rank, no ZeRO partitioning)."""

    parameters: int
    """Trainable parameters of the traced model."""
    largest_module_parameters: int
    """Parameters of the largest module's own tensors (what ZeRO-3 gathers at once)."""
    activation_bytes: int
    """Activations live at the peak (MemTracker ``ACT``)."""
    temporary_bytes: int
    """Temporaries live at the peak (MemTracker ``TEMP``: e.g. the loss's FP32 logits)."""
    peak_bytes: int
    """Everything live at the peak, parameters included."""
    peak_phase: str
    """``forward`` or ``backward``: where the peak happened."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceFailure:
    """The model could not be traced; the formula is used instead."""

    op: str
    """The operation (or exception type) that failed."""
    message: str
    """The first line of the error."""


def trace_key(*, model_spec: dict[str, Any], entry_point: str | None, checkpointing: str, precision: Precision,
              micro_batch: int, sequence_length: int) -> str:
    """A cache key of everything that determines a trace."""
    payload = {"model": model_spec, "entry_point": entry_point, "checkpointing": checkpointing,
               "precision": str(precision), "micro_batch": micro_batch, "seq": sequence_length,
               "torch": torch.__version__}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def trace(*, model_spec: dict[str, Any], entry_point: str | None, checkpointing: str, precision: Precision,
          micro_batch: int, sequence_length: int) -> TraceResult | TraceFailure:
    """Trace one forward + backward of ``micro_batch`` samples (module doc)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    previous = torch.get_default_dtype()
    try:
        with FakeTensorMode():
            torch.set_default_dtype(DTYPES[precision])
            try:
                if entry_point is None:  # the model alone: the synthetic data's setup needs real values
                    model = GPT(model_spec, checkpointing=checkpointing)
                else:
                    model, _ = build_workload(model_spec=model_spec, checkpointing=checkpointing,
                                              sequence_length=sequence_length, seed=0, entry_point=entry_point)
            finally:
                torch.set_default_dtype(previous)
            tokens = torch.randint(0, int(model_spec.get("vocab_size", 2)), (micro_batch, sequence_length + 1))
            tracker = MemTracker()
            tracker.track_external(model)
            with tracker:
                loss = model(tokens)
                after_forward = _total(tracker.get_tracker_snapshot("current"))
                loss.backward()
            peak = _by_kind(tracker.get_tracker_snapshot("peak"))
    except Exception as err:  # every failure of a trace is data: the caller falls back to the formula
        return _failure(err)
    params = [p for p in model.parameters() if p.requires_grad]
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    return TraceResult(parameters=sum(p.numel() for p in params), largest_module_parameters=max(own, default=0),
                       activation_bytes=peak.get("Activation", 0), temporary_bytes=peak.get("Temp", 0),
                       peak_bytes=peak.get("Total", 0),
                       peak_phase="backward" if peak.get("Total", 0) > after_forward else "forward")


def _by_kind(snapshot: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for per_device in snapshot.values():
        for kind, amount in per_device.items():
            name = getattr(kind, "value", str(kind))
            out[name] = out.get(name, 0) + int(amount)
    return out


def _total(snapshot: dict) -> int:
    return _by_kind(snapshot).get("Total", 0)


def _failure(err: Exception) -> TraceFailure:
    first = (str(err).strip().splitlines() or [""])[0]
    op = getattr(err, "func", None) or getattr(err, "op", None)
    name = str(op) if op is not None else type(err).__name__
    if op is None and "aten." in first:  # "... for aten.nonzero.default ..." in the message
        name = next((word.strip(".,:()'`") for word in first.split() if word.startswith("aten.")), name)
    return TraceFailure(op=name, message=first[:300])


def cached_trace(*, cache: Path, model_spec: dict[str, Any], entry_point: str | None, checkpointing: str,
                 precision: Precision, micro_batch: int, sequence_length: int) -> TraceResult | TraceFailure:
    """:func:`trace`, cached in the JSON file ``cache`` (failures are cached too, with their reason)."""
    key = trace_key(model_spec=model_spec, entry_point=entry_point, checkpointing=checkpointing, precision=precision,
                    micro_batch=micro_batch, sequence_length=sequence_length)
    data = json.loads(cache.read_text()) if cache.exists() else {}
    if key in data:
        entry = data[key]
        return TraceResult(**entry["result"]) if entry["ok"] else TraceFailure(**entry["result"])
    result = trace(model_spec=model_spec, entry_point=entry_point, checkpointing=checkpointing, precision=precision,
                   micro_batch=micro_batch, sequence_length=sequence_length)
    data[key] = {"ok": isinstance(result, TraceResult), "result": asdict(result)}
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(cache)
    return result


def trace_rows(*, study: Any, cache: Path | None = None) -> list[dict[str, Any]]:
    """One row per (checkpointing, precision) of the study's space at its baseline micro-batch: the trace
    beside the analytic formula (or the failure, with the formula as the figure used)."""
    from launchers.trial import model_dict
    from optimizer.knobs import parse_checkpointing
    from optimizer.transformer import activation_estimate, parameter_count

    values = dict(study.search_space.values)
    model = study.model
    spec = model_dict(model)
    rows = []
    for ckpt in values.get("checkpointing", ("none",)):
        for precision in values.get("precision", (Precision.FP32,)):
            precision = Precision(str(precision))
            if precision not in study.hardware.supported_precisions:
                continue
            mbs, seq = study.training.micro_batch_size, study.training.sequence_length
            formula = activation_estimate(model, checkpointing=parse_checkpointing(str(ckpt)), seq=seq,
                                          micro_batch=mbs, element_bytes=4 if precision is Precision.FP32 else 2)
            kwargs = {"model_spec": spec, "entry_point": model.entry_point, "checkpointing": str(ckpt),
                      "precision": precision, "micro_batch": mbs, "sequence_length": seq}
            result = cached_trace(cache=cache, **kwargs) if cache is not None else trace(**kwargs)
            row = {"checkpointing": str(ckpt), "precision": str(precision), "micro_batch": mbs,
                   "formula_bytes": formula.stored_bytes + formula.recompute_bytes,
                   "formula_parameters": parameter_count(model)}
            row.update({"source": "trace", **asdict(result)} if isinstance(result, TraceResult)
                       else {"source": "formula (trace failed)", "failure": asdict(result)})
            rows.append(row)
    return rows
