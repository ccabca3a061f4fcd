"""What ZeRO-3 holds of the parameters over a traced step: DeepSpeed's coordinator replayed over the trace's module
events (:mod:`optimizer.deepspeed.zero3_gather`) at the sizes dsopt sets for the model, with the copies autograd keeps
past a release (4-bit weights bitsandbytes' matmul kept) and a frozen reference copy's own coordinator, joined with
the trace's activations per stretch."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from launchers.models.four_bit import HELD_TAG, is_four_bit
from optimizer.deepspeed.zero3_gather import GatherSettings, autograd_copies, gathered, replay
from optimizer.deepspeed.zero_settings import gather_settings
from optimizer.ledger.quantized import packed_elements
from optimizer.study.quantization_section import STORAGE_BYTES


def zero3_gathered(model: nn.Module, modules: list[nn.Module], tracker: Any, model_spec: dict[str, Any],
                   reference: nn.Module | None = None) -> tuple[int, int, tuple[tuple[int, int, int, int], ...], int,
                                                            tuple[int, ...]]:
    """(most, after forward) parameter elements ZeRO-3 keeps gathered over this traced step, with the sizes
    dsopt sets for the model (:mod:`optimizer.deepspeed.zero3_gather`), the joint peak of the activations and
    the gathered bytes per stretch (:attr:`launchers.trace.tracer.TraceResult.zero3_joint_segments`), and the bytes
    of the 4-bit weights autograd keeps (:attr:`launchers.trace.tracer.TraceResult.zero3_autograd_held_bytes`).
    ``reference``: a frozen copy whose modules follow ``modules`` in the traced events (:func:`traced_modules`), held
    by a coordinator of its own (:func:`reference_held`): the last part is the moment the copy's gathers, the
    model's and the activations together peak (:func:`reference_joint`), () without a copy."""
    if not model_spec.get("hidden_size") or not tracker.module_events:
        return 0, 0, (), 0, ()  # the sizes dsopt sets come from the width
    events = tracker.module_events
    count = len(modules)
    own = [event for event in events if event[1] < count]
    module_params = owned_params(model, modules)
    quantization = model_spec.get("quantization") or {}
    storage = STORAGE_BYTES[quantization.get("bnb_4bit_quant_storage", "uint8")]
    # a 4-bit weight is gathered as its packed storage elements (optimizer.ledger.transformer.held_tensors)
    params = list(model.parameters())
    numel = [packed_elements(p.numel(), storage_bytes=storage) if is_four_bit(p) else p.numel() for p in params]
    weights = [n * (storage if is_four_bit(p) else p.element_size()) for n, p in zip(numel, params, strict=True)]
    frozen = [i for i, p in enumerate(params) if not p.requires_grad]  # a recomputation holds these (zero3_gather)
    settings = sizes = gather_settings(int(model_spec["hidden_size"]))
    if model_spec.get("reference_model") and model_spec.get("peft"):
        # The policy runs forward twice a micro-step, the second with its adapters disabled as the reference
        # (launchers/models/reference.py). DeepSpeed resets its coordinator's step at every forward of the engine's
        # module (parameter_offload.py:303-306), so the trace it records is the first forward's alone, and the second
        # does not follow it and invalidates it (partitioned_param_coordinator.py:202-219) — every micro-step,
        # measured: nothing is prefetched and each module's parameters are released after it runs (:498-499)
        settings = replace(settings, prefetch_bucket=0, max_reuse_distance=0)
    most, turn = gathered(events=own, module_params=module_params, param_numel=numel, settings=settings,
                          frozen=frozen)
    # the coalesced buffers, in a later step or in the first prefetching one (it gathers the persistent tensors too,
    # zero3_gather), whichever holds more: kept apart, since they do not grow with the depth as the rest does
    kwargs = {"events": own, "module_params": module_params, "param_numel": numel, "settings": settings,
              "weights": weights, "frozen": frozen}
    held = replay(**kwargs)
    buffered = [max(a, b) - h for a, b, h in zip(replay(**kwargs, buffers=True),
                                                 replay(**kwargs, buffers=True, first_step=True), held, strict=True)]
    # a 4-bit weight bitsandbytes' matmul kept for backward outlives its release, and the trial's loop holds the
    # previous micro-step's graph through the next forward (zero3_gather module doc)
    by_autograd = [i for i, p in enumerate(params) if getattr(p, HELD_TAG, False)]
    copies = autograd_copies(**kwargs, held=by_autograd, previous_graph=True) if by_autograd else [0] * len(held)
    held_bytes = sum(weights[i] for i in by_autograd if numel[i] > settings.persistence_threshold)
    mine = [event[1] < count for event in events]
    per_event = [along(mine, values) for values in (held, buffered, copies)]
    theirs = reference_held(reference, events, count, settings=sizes)  # the copy keeps the training's sizes
    joint = zero3_joint(*per_event, tracker.interval_marks, len(tracker.segments))
    return most, turn, joint, held_bytes, reference_joint(*per_event, theirs, tracker.interval_marks)


def traced_modules(model: nn.Module, reference: nn.Module | None, model_spec: dict[str, Any]) -> list[nn.Module]:
    """The modules whose DeepSpeed events a trace records: the model's, then a frozen reference copy's when it is an
    engine of its own (TRL's ``prepare_deepspeed``, :mod:`launchers.models.reference`) — not with PEFT, where the
    trace's copy stands in for the policy itself with its adapters disabled."""
    own = list(model.modules())
    if reference is None or model_spec.get("peft"):
        return own
    return [*own, *reference.modules()]


def reference_held(reference: nn.Module | None, events: list[tuple[str, int]], count: int, *,
                   settings: GatherSettings) -> list[int]:
    """After each of ``events``, the bytes a frozen reference copy's own ZeRO-3 coordinator holds gathered or in
    flight (0 for all without a copy): its modules are those past the first ``count`` (:func:`traced_modules`).

    TRL's copy is an engine of its own with the training's ZeRO-3 sizes (:mod:`launchers.models.reference`), and its
    coordinator's trace is its forward alone (no backward runs through it), so its prefetch runs ahead of its modules
    by at least one entry per fetch (:mod:`optimizer.deepspeed.zero3_gather`) and a prefetched parameter is held from
    its all-gather until its module runs: measured on 2 CPU ranks (the tiny Llama of
    ``studies/grid-reference-llama-cpu.yaml``, z3 fp32, a hook at each MLP), the copy held its first MLP's 33,792
    elements and had the whole next block and the head in flight (62,464), 96,256 of its 125,248, where one prefetch
    bucket and the largest module say 20,070. Its coalesced buckets' flat buffers are in (``buffers``)."""
    theirs = [(kind, m - count) for kind, m in events if m >= count]
    if reference is None or not theirs:
        return [0] * len(events)
    params = list(reference.parameters())
    kwargs = {"events": theirs, "module_params": owned_params(reference, list(reference.modules())),
              "param_numel": [p.numel() for p in params],
              "settings": settings, "weights": [p.numel() * p.element_size() for p in params]}
    most = [max(a, b) for a, b in zip(replay(**kwargs, buffers=True), replay(**kwargs, buffers=True, first_step=True),
                                      strict=True)]
    return along([m >= count for _, m in events], most)


def owned_params(model: nn.Module, modules: list[nn.Module]) -> list[list[int]]:
    """Per module of ``modules``, the indices (in ``model.parameters()``) of the parameters it owns directly."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [[index[id(p)] for p in m.parameters(recurse=False) if id(p) in index] for m in modules]


def along(mine: list[bool], values: list[int]) -> list[int]:
    """``values`` (one after each event where ``mine`` is true) as they stand after every event: the last one's
    until the next, 0 before the first."""
    out, now, taken = [], 0, iter(values)
    for is_mine in mine:
        if is_mine:
            now = next(taken)
        out.append(now)
    return out


def zero3_joint(held: list[int], buffered: list[int], copies: list[int], marks: dict[tuple[int, int], int],
                stretches: int) -> tuple[tuple[int, int, int, int], ...]:
    """Per stretch, (activations, gathered bytes, buffered bytes, autograd's copies) where their sum peaked
    (:attr:`launchers.trace.tracer.TraceResult.zero3_joint_segments`): ``held[i]``, ``buffered[i]`` and
    ``copies[i]`` are what is gathered or kept from module event ``i`` to the next (DeepSpeed fetches at a
    module's pre-hook, before its ops, and releases at its post-hook, after them), ``marks[(i + 1, stretch)]``
    the activations' high-water mark then."""
    out = [(0, 0, 0, 0)] * stretches
    for (interval, stretch), working in marks.items():
        now = (working, held[interval - 1], buffered[interval - 1], copies[interval - 1]) if interval else \
            (working, 0, 0, 0)
        if sum(now) > sum(out[stretch]):
            out[stretch] = now
    return tuple(out)


def reference_joint(held: list[int], buffered: list[int], copies: list[int], reference: list[int],
                    marks: dict[tuple[int, int], int]) -> tuple[int, ...]:
    """(activations, gathered bytes, buffered bytes, autograd's copies, a reference copy's gathered bytes) where
    their sum peaked over the whole step, () without a copy
    (:attr:`launchers.trace.tracer.TraceResult.zero3_reference_joint`; the parts as :func:`zero3_joint`'s)."""
    if not any(reference):
        return ()
    best: tuple[int, ...] = (0, 0, 0, 0, 0)
    for (interval, _), working in marks.items():
        if interval:
            at = interval - 1
            now = (working, held[at], buffered[at], copies[at], reference[at])
            if sum(now) > sum(best):
                best = now
    return best
