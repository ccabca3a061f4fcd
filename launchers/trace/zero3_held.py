"""What ZeRO-3 holds of the parameters over a traced step: DeepSpeed's coordinator replayed over the trace's module
events (:mod:`optimizer.deepspeed.zero3_gather`) at the sizes dsopt sets for the model, with the copies autograd keeps
past a release (4-bit weights bitsandbytes' matmul kept), joined with the trace's activations per stretch."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from launchers.models.four_bit import HELD_TAG, is_four_bit
from optimizer.deepspeed.zero3_gather import autograd_copies, gathered, replay
from optimizer.deepspeed.zero_settings import gather_settings
from optimizer.ledger.quantized import packed_elements
from optimizer.study.quantization_section import STORAGE_BYTES


def zero3_gathered(model: nn.Module, modules: list[nn.Module], tracker: Any,
                   model_spec: dict[str, Any]) -> tuple[int, int, tuple[tuple[int, int, int, int], ...], int]:
    """(most, after forward) parameter elements ZeRO-3 keeps gathered over this traced step, with the sizes
    dsopt sets for the model (:mod:`optimizer.deepspeed.zero3_gather`), the joint peak of the activations and
    the gathered bytes per stretch (:attr:`launchers.trace.tracer.TraceResult.zero3_joint_segments`), and the bytes
    of the 4-bit weights autograd keeps (:attr:`launchers.trace.tracer.TraceResult.zero3_autograd_held_bytes`)."""
    if not model_spec.get("hidden_size") or not tracker.module_events:
        return 0, 0, (), 0  # the sizes dsopt sets come from the width
    events = tracker.module_events
    index = {id(p): i for i, p in enumerate(model.parameters())}
    module_params = [[index[id(p)] for p in m.parameters(recurse=False) if id(p) in index] for m in modules]
    quantization = model_spec.get("quantization") or {}
    storage = STORAGE_BYTES[quantization.get("bnb_4bit_quant_storage", "uint8")]
    # a 4-bit weight is gathered as its packed storage elements (optimizer.ledger.transformer.held_tensors)
    params = list(model.parameters())
    numel = [packed_elements(p.numel(), storage_bytes=storage) if is_four_bit(p) else p.numel() for p in params]
    weights = [n * (storage if is_four_bit(p) else p.element_size()) for n, p in zip(numel, params, strict=True)]
    frozen = [i for i, p in enumerate(params) if not p.requires_grad]  # a recomputation holds these (zero3_gather)
    settings = gather_settings(int(model_spec["hidden_size"]))
    if model_spec.get("reference_model") and model_spec.get("peft"):
        # The policy runs forward twice a micro-step, the second with its adapters disabled as the reference
        # (launchers/models/reference.py). DeepSpeed resets its coordinator's step at every forward of the engine's
        # module (parameter_offload.py:303-306), so the trace it records is the first forward's alone, and the second
        # does not follow it and invalidates it (partitioned_param_coordinator.py:202-219) — every micro-step,
        # measured: nothing is prefetched and each module's parameters are released after it runs (:498-499)
        settings = replace(settings, prefetch_bucket=0, max_reuse_distance=0)
    most, turn = gathered(events=events, module_params=module_params, param_numel=numel, settings=settings,
                          frozen=frozen)
    # the coalesced buffers, in a later step or in the first prefetching one (it gathers the persistent tensors too,
    # zero3_gather), whichever holds more: kept apart, since they do not grow with the depth as the rest does
    kwargs = {"events": events, "module_params": module_params, "param_numel": numel, "settings": settings,
              "weights": weights, "frozen": frozen}
    held = replay(**kwargs)
    buffered = [max(a, b) - h for a, b, h in zip(replay(**kwargs, buffers=True),
                                                 replay(**kwargs, buffers=True, first_step=True), held, strict=True)]
    # a 4-bit weight bitsandbytes' matmul kept for backward outlives its release, and the trial's loop holds the
    # previous micro-step's graph through the next forward (zero3_gather module doc)
    by_autograd = [i for i, p in enumerate(params) if getattr(p, HELD_TAG, False)]
    copies = autograd_copies(**kwargs, held=by_autograd, previous_graph=True) if by_autograd else [0] * len(held)
    held_bytes = sum(weights[i] for i in by_autograd if numel[i] > settings.persistence_threshold)
    return most, turn, zero3_joint(held, buffered, copies, tracker.interval_marks, len(tracker.segments)), held_bytes


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
