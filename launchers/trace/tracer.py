"""Traced activations: the study's own model on fake tensors, one micro-batch forward + backward.

PyTorch's ``FakeTensorMode`` runs the model without allocating memory (shapes, dtypes and devices only), and
``torch.distributed._tools.mem_tracker.MemTracker`` attributes every tensor it sees to parameters,
gradients, activations (``ACT``: made in forward or in a recomputation) or temporaries (``TEMP``: made in
backward, e.g. activation gradients). So a 1B-parameter model traces in seconds on a machine without a GPU.
The model is the built-in GPT (:mod:`launchers.models.builtin`), the ``transformers`` model of ``model.hf_config``
(:mod:`launchers.models.hf_model`) or the study's entry point, built directly in the training dtype (bf16/fp16 as
DeepSpeed casts it, fp32 otherwise).

What the ledger takes from a trace is the **high-water mark of activations + temporaries** over forward and
backward: MemTracker's own peak is of the total, which under checkpointing sits at the end of backward
where parameters + gradients dominate and the activations are already freed — the wrong moment for the
activation term. The high-water mark is kept by a MemTracker subclass that looks at every update. Sizes
are rounded up to 512 bytes per storage as CUDA's caching allocator does (MemTracker's rule).

A model that cannot be traced — a data-dependent shape, an op without a fake implementation, a missing
package — gives a :class:`TraceFailure` naming the op, and callers fall back to the formula; tracing never
crashes a study. Results are cached by :mod:`launchers.trace.study_traces`, keyed by content (the model, the step's
shape, the library versions and this module's own source: an edit here traces again).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from launchers.models.fake_kernels import (
    copies_keep_their_fake_mode,
    grouped_mm_for_fake_tensors,
    import_before_faking,
    in_one_fake_mode,
)
from launchers.models.four_bit import emulate_four_bit_matmuls
from launchers.models.reference import anchored, freeze_all, frozen_copy_spec, reference_forward
from launchers.models.zero3_linear import deepspeed_linear
from launchers.trace.cpu_kernels import cpu_promotion_copies
from launchers.trace.zero3_events import deepspeed_module_events
from launchers.trace.zero3_held import traced_modules, zero3_gathered
from optimizer.study.knobs import Precision
from optimizer.study.traced_activation import ADAPTERS_CAST, CPU_KERNELS, ZERO3_RUN

DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
WORKING_KINDS = ("Activation", "Temp")
"""MemTracker kinds that are activations (as opposed to parameters, buffers, gradients, optimizer states)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceResult:
    """What one traced micro-batch needed (bytes per rank, no ZeRO partitioning)."""

    parameters: int
    """Trainable parameters of the traced model."""
    largest_module_parameters: int
    """Parameters of the largest module's own tensors (what ZeRO-3 gathers at once)."""
    activation_peak_bytes: int
    """High-water mark of activations + temporaries over forward and backward: the ledger's figure."""
    peak_phase: str
    """``forward`` or ``backward``: where that high-water mark was."""
    stored_bytes: int
    """Activations + temporaries live when forward ends (what is kept for backward, and the loss)."""
    blocks_stored_bytes: int
    """Of ``stored_bytes``, what the decoder blocks left behind (their forwards' net activation growth)."""
    blocks: int
    """Decoder blocks found (the model's first ``ModuleList``; 0 when it has none)."""
    total_peak_bytes: int
    """MemTracker's own peak of everything live, parameters and gradients included."""
    kept_by_op: dict[str, int]
    """``stored_bytes`` by the forward op that made each tensor (``aten.clone``: contiguous copies; …),
    largest first: the trace's own term-by-term account."""
    joint_segments: tuple[tuple[int, int], ...] = ()
    """(activations + temporaries, gradients made so far) where their sum peaked, in forward and then in each
    stretch of backward after 0, 1, …, L blocks' backward completed: the phase-aware join of activations and
    autograd's gradients (early in backward few gradients exist, late in backward few activations do);
    :func:`joint_peak` is its maximum. Kept per stretch so shallow copies extend to the full depth."""
    working_segments: tuple[int, ...] = ()
    """The activations' high-water mark in the same stretches (``activation_peak_bytes`` is their maximum):
    within a stretch every moment grows alike with the depth, between stretches not (the embedding's backward
    is the same at any depth, the start of backward grows with it)."""
    ungraded_segments: tuple[int, ...] = ()
    """The activations' high-water mark in the same stretches at moments before autograd made any gradient
    (forward, and the start of backward: the loss and the head), 0 for a stretch with no such moment. ZeRO-2
    allocates its gradient bucket and partition at the first gradient's hook, so they are not live then."""
    graded_segments: tuple[int, ...] = ()
    """The same at moments once some gradient exists (``working_segments`` is the larger of the two)."""
    zero3_gathered_elements: int = 0
    """The most parameter elements ZeRO-3 would keep gathered at once over this step: DeepSpeed's coordinator
    replayed over the traced module order (:mod:`optimizer.deepspeed.zero3_gather`)."""
    zero3_gathered_after_forward: int = 0
    """Of those, what is gathered when forward ends."""
    zero3_autograd_held_bytes: int = 0
    """Bytes of the non-persistent 4-bit weights bitsandbytes' matmul kept for backward in this step
    (:func:`optimizer.deepspeed.zero3_gather.autograd_copies`): what autograd keeps of them whatever ZeRO-3
    releases."""
    zero3_joint_segments: tuple[tuple[int, int, int, int], ...] = ()
    """(activations + temporaries, bytes of parameters ZeRO-3 holds gathered — each in its own dtype —, bytes of the
    coalesced prefetch buffers that outlive their wait, bytes of released parameters autograd still holds —
    :func:`optimizer.deepspeed.zero3_gather.autograd_copies`: 4-bit weights bitsandbytes' matmul kept —) where
    their sum peaked, per stretch as ``joint_segments``:
    the coordinator replayed over the traced module order gives what is gathered between two module events, the
    trace what is live then. With full checkpointing the two peak apart (the gathers at the turn to backward, the
    activations while a block is recomputed), so this is less than their maxima added. The buffers are kept apart:
    a few prefetch buckets, they do not grow with the depth (:func:`launchers.trace.trace_depth.extrapolate`)."""
    zero3_reference_joint: tuple[int, ...] = ()
    """With a frozen reference copy, the same four parts and the bytes the copy's own coordinator holds gathered or
    in flight (:func:`launchers.trace.zero3_held.reference_held`) where all five together peaked over the step; ()
    without a copy, and in a trace extended from shallow copies (:func:`launchers.trace.trace_depth.extrapolate`)."""
    notes: tuple[str, ...] = ()
    """What the trace assumed, stated (e.g. how MoE experts were run)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceFailure:
    """The model could not be traced; the formula is used instead."""

    op: str
    """The operation (or exception type) that failed."""
    message: str
    """The first line of the error."""
    transient: bool = False
    """The machine failed, not the model (out of host memory, an OS error, a timeout): never cached, traced again
    next time (:meth:`launchers.trace.study_traces.TraceCache.entry`)."""


def _kinds(snapshot: dict) -> dict[str, int]:
    """Bytes per MemTracker kind name (``Activation``, ``Temp``, ``Parameter``, …, ``Total``), all devices."""
    out: dict[str, int] = {}
    for per_device in snapshot.values():
        for kind, amount in per_device.items():
            name = getattr(kind, "value", str(kind))
            out[name] = out.get(name, 0) + int(amount)
    return out


def _working(snapshot: dict) -> int:
    kinds = _kinds(snapshot)
    return sum(kinds.get(kind, 0) for kind in WORKING_KINDS)


def _tracker(blocks: nn.ModuleList | None = None) -> Any:
    """A MemTracker that also keeps the activations' high-water mark and its phase, and the joint peak of
    activations + gradients per segment of the step (module doc; :func:`joint_peak`)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY as TOTAL_KEY
    from torch.distributed._tools.mem_tracker import MemTracker

    block_ids = {id(block) for block in blocks} if blocks is not None else set()

    class NoHook:
        """A frozen parameter's stand-in for the two grad-hook handles MemTracker removes on exit."""

        def remove(self) -> None:
            return None

    class HighWaterTracker(MemTracker):
        def _track_module_params_and_buffers(self, module: nn.Module,
                                             install_grad_hooks: bool = True) -> tuple[int, int]:
            # torch 2.13's MemTracker hooks every parameter's gradient (mem_tracker.py:597-610), and
            # register_hook refuses a frozen one ("cannot register a hook on a tensor that doesn't require
            # gradient"): a frozen parameter gets no gradient to track, so it is marked as hooked already.
            for param in module.parameters():
                if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (NoHook(), NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def __init__(self) -> None:
            super().__init__()
            self.working_peak = 0
            self.working_phase = "forward"
            self.blocks_done = 0  # decoder blocks whose backward has completed
            self.segments: list[tuple[int, int]] = [(0, 0)]  # forward, then after 0, 1, … blocks' backward
            self.working_segments: list[int] = [0]  # the same stretches' activation high-water marks
            self.ungraded_segments: list[int] = [0]  # … before any gradient exists
            self.graded_segments: list[int] = [0]  # … once one does
            # (forward_pre | … | backward_post, module index) in DeepSpeed's order (launchers.trace.zero3_events)
            self.module_events: list[tuple[str, int]] = []
            # (module events so far, stretch) -> the activations' high-water mark between two module events: what
            # is live beside the parameters ZeRO-3 holds gathered from one event to the next
            # (launchers.trace.zero3_held.zero3_joint)
            self.interval_marks: dict[tuple[int, int], int] = {}

        def note(self, kind: str, index: int) -> None:
            self.module_events.append((kind, index))

        def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
            super()._post_bw_hook(module, args)
            if id(module) in block_ids:
                self.blocks_done += 1

        def _update_peak_stats(self, peak_state: Any) -> None:  # called after every op's outputs are tracked
            # torch's own (mem_tracker.py:502-524) first walks every tracked module for its per-module peak
            # (PEAK_FW/PEAK_BW), a weak-reference walk per op that was ~40 % of a PEFT'd model's trace; no figure
            # here reads those peaks (the blocks' growth reads PRE_FW/POST_FW, taken by the module hooks), so
            # only the tracker-wide peak behind get_tracker_snapshot("peak") is kept
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(dev_snap)
            kinds = _kinds(self._curr_mem_snap)
            working = sum(kinds.get(kind, 0) for kind in WORKING_KINDS)
            if working > self.working_peak:
                self.working_peak = working
                self.working_phase = "backward" if self._mod_tracker.is_bw else "forward"
            segment = 1 + self.blocks_done if self._mod_tracker.is_bw else 0
            while len(self.segments) <= segment:
                self.segments.append((0, 0))
                self.working_segments.append(0)
                self.ungraded_segments.append(0)
                self.graded_segments.append(0)
            self.working_segments[segment] = max(self.working_segments[segment], working)
            interval = (len(self.module_events), segment)
            self.interval_marks[interval] = max(self.interval_marks.get(interval, 0), working)
            grads = kinds.get("Gradient", 0)
            split = self.graded_segments if grads else self.ungraded_segments
            split[segment] = max(split[segment], working)
            pair = (working, grads)
            if sum(pair) > sum(self.segments[segment]):
                self.segments[segment] = pair

    return HighWaterTracker()


def joint_peak(segments: tuple[tuple[int, int], ...] | list[tuple[int, int]]) -> tuple[int, int]:
    """(activations + temporaries, gradients so far) at the moment their sum peaked, over every segment."""
    return max(segments, key=sum, default=(0, 0))


ALLOCATION_GRANULE = 512
"""Bytes: MemTracker rounds each storage up to CUDA's smallest block (``_PYTORCH_MIN_ALLOCATE``); so do we."""


def _kept_by_op_mode(existing: list[torch.Tensor]) -> Any:
    """A dispatch mode noting which forward op made each new storage; ``kept()`` sums those still alive."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map_only
    from torch.utils.weak import WeakIdKeyDictionary

    class KeptByOp(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.maker: WeakIdKeyDictionary = WeakIdKeyDictionary()
            for tensor in existing:  # parameters, buffers, inputs: their views are not new memory
                self.maker[tensor.untyped_storage()] = None

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = str(getattr(func, "overloadpacket", func))

            def note(tensor: torch.Tensor) -> None:
                storage = tensor.untyped_storage()
                if storage not in self.maker:
                    self.maker[storage] = name

            tree_map_only(torch.Tensor, note, out)
            return out

        def kept(self) -> dict[str, int]:
            totals: dict[str, int] = {}
            for storage, name in self.maker.items():
                if name is not None and storage.nbytes():
                    size = -(-storage.nbytes() // ALLOCATION_GRANULE) * ALLOCATION_GRANULE
                    totals[name] = totals.get(name, 0) + size
            return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    return KeptByOp()


def _block_growth(tracker: Any, block: nn.Module) -> int:
    """Activations a block's (first) forward left behind: post-forward minus pre-forward."""
    from torch.distributed._tools.mem_tracker import _ModState

    stats = tracker.memory_tracking.get(block)
    if stats is None or _ModState.PRE_FW not in stats.snapshots or _ModState.POST_FW not in stats.snapshots:
        return 0
    return _working(stats.snapshots[_ModState.POST_FW][0]) - _working(stats.snapshots[_ModState.PRE_FW][0])


def trace(*, model_spec: dict[str, Any], checkpointing: str, precision: Precision, micro_batch: int,
          sequence_length: int) -> TraceResult | TraceFailure:
    """Trace one forward + backward of ``micro_batch`` samples (module doc), each ``sequences_per_sample`` rows when
    the spec says so (a DPO pair's chosen and rejected completions). ``model_spec`` is
    :func:`launchers.trial.run.model_dict` of the study's model (its ``entry_point`` and ``hf_config`` included), with
    :data:`optimizer.study.traced_activation.ZERO3_RUN` for the variant of a ZeRO-3 run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from launchers.models.blocks import decoder_blocks
    from launchers.models.builtin import build_model, load_entry_point
    from launchers.models.trainable import apply_trainable

    previous = torch.get_default_dtype()
    notes: list[str] = []
    zero3 = bool(model_spec.get(ZERO3_RUN))
    # the module events drive the ZeRO-3 replay: a model that trains in part has its ZeRO-3 trace apart, so its others
    # need none (the events' autograd functions are ~15 % of a trace)
    events = zero3 or not any(model_spec.get(key) for key in ("peft", "frozen", "quantization"))
    import_before_faking(model_spec)
    try:
        # what the model prints goes to stderr: stdout may carry ``--json``
        with FakeTensorMode() as mode, copies_keep_their_fake_mode(), grouped_mm_for_fake_tensors(notes), \
                contextlib.redirect_stdout(sys.stderr):
            torch.set_default_dtype(DTYPES[precision])
            try:
                if model_spec.get("entry_point"):
                    model, _ = load_entry_point(model_spec["entry_point"])(model_spec, sequence_length, 0,
                                                                           checkpointing)
                else:  # the model alone: the synthetic data's setup needs real values
                    model = build_model(model_spec, checkpointing=checkpointing)
                # autograd keeps what the frozen/adapted model needs; the adapters in the training dtype, as the
                # engine casts them — but not under ZeRO-3 where the model built by zero.Init is not cast
                # (engine.py:1859-1862, 2077) and PEFT's adapters stay fp32 (lora/layer.py:1100 casts their input):
                # the study says which (ADAPTERS_CAST, from constraints.zero3_keeps_adapters_fp32)
                four_bit = model_spec.get("quantization")
                casts = not zero3 or bool(model_spec.get(ADAPTERS_CAST))
                model = apply_trainable(model, model_spec, as_deepspeed_casts=casts)
                in_one_fake_mode(model, mode)  # a copy made outside copies_keep_their_fake_mode (none known)
                if four_bit:  # the 4-bit layers' dequantized weights, where they happen
                    emulate_four_bit_matmuls(model, four_bit)
                reference = _reference_model(model_spec, sequence_length)
            finally:
                torch.set_default_dtype(previous)
            rows = micro_batch * int(model_spec.get("sequences_per_sample", 1))  # a DPO pair: chosen + rejected
            tokens = torch.randint(0, int(model_spec.get("vocab_size", 2)), (rows, sequence_length + 1))
            blocks = decoder_blocks(model)
            modules = list(model.modules())
            tracker = _tracker(blocks)
            tracker.track_external(model)
            by_op = _kept_by_op_mode([*model.parameters(), *model.buffers(), tokens])
            with tracker, deepspeed_module_events(traced_modules(model, reference, model_spec) if events else [],
                                                  tracker.note), \
                    deepspeed_linear() if zero3 else contextlib.nullcontext(), \
                    cpu_promotion_copies(bool(model_spec.get(CPU_KERNELS))):
                with by_op:
                    loss = model(tokens)
                stored = _working(tracker.get_tracker_snapshot("current"))
                kept_by_op = by_op.kept()
                if model_spec.get("reference_model"):  # after the policy's forward, as TRL runs it
                    loss = anchored(loss, reference_forward(policy=model, reference=reference, batch=tokens))
                loss.backward()
            total_peak = _kinds(tracker.get_tracker_snapshot("peak")).get("Total", 0)
            blocks_stored = sum(_block_growth(tracker, block) for block in blocks) if blocks is not None else 0
    except Exception as err:  # every failure of a trace is data: the caller falls back to the formula
        return _failure(err)
    params = [p for p in model.parameters() if p.requires_grad]
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    gathered, gathered_turn, zero3_joint, autograd_held, reference_joint = zero3_gathered(
        model, modules, tracker, model_spec, reference=reference)
    return TraceResult(parameters=sum(p.numel() for p in params), largest_module_parameters=max(own, default=0),
                       activation_peak_bytes=tracker.working_peak, peak_phase=tracker.working_phase,
                       stored_bytes=stored, blocks_stored_bytes=blocks_stored,
                       blocks=len(blocks) if blocks is not None else 0, total_peak_bytes=total_peak,
                       kept_by_op=kept_by_op, joint_segments=tuple(tracker.segments),
                       working_segments=tuple(tracker.working_segments),
                       ungraded_segments=tuple(tracker.ungraded_segments),
                       graded_segments=tuple(tracker.graded_segments), notes=tuple(notes),
                       zero3_gathered_elements=gathered, zero3_gathered_after_forward=gathered_turn,
                       zero3_autograd_held_bytes=autograd_held,
                       zero3_joint_segments=zero3_joint, zero3_reference_joint=reference_joint)


def _reference_model(model_spec: dict[str, Any], sequence_length: int) -> nn.Module | None:
    """The frozen reference copy (:mod:`launchers.models.reference`), in the current (training) dtype as TRL loads
    it, or None without a reference. Built before the tracker starts, its parameters are not the step's
    activations; its forward's working memory is. With PEFT the ranks run the policy with its adapters disabled
    instead, which MemTracker cannot follow (a module's second forward in one step raises NotImplementedError):
    the same base model as a copy runs the same ops on the same shapes."""
    from launchers.models.builtin import build_model, load_entry_point

    if not model_spec.get("reference_model"):
        return None
    spec = frozen_copy_spec(model_spec)
    if spec.get("entry_point"):
        model, _ = load_entry_point(spec["entry_point"])(spec, sequence_length, 0, "none")
    else:
        model = build_model(spec, checkpointing="none")
    return freeze_all(model)


TRANSIENT_ERRORS = (MemoryError, OSError, TimeoutError)
"""Failures of the machine rather than of the model's operations: a trace that met one is not a property of the
model, its key's code and versions — the cause may be gone on the next run."""


def _failure(err: Exception) -> TraceFailure:
    first = (str(err).strip().splitlines() or [""])[0]
    op = getattr(err, "func", None) or getattr(err, "op", None)
    name = str(op) if op is not None else type(err).__name__
    if op is None and "aten." in first:  # "... for aten.nonzero.default ..." in the message
        name = next((word.strip(".,:()'`") for word in first.split() if word.startswith("aten.")), name)
    return TraceFailure(op=name, message=first[:300], transient=isinstance(err, TRANSIENT_ERRORS))
