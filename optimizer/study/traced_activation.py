"""Traced activation bytes of one (checkpointing, precision): what the trace of the study's own model gave, at
each micro-batch of the search space, and its value between them (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from optimizer.study.knobs import Precision, coerce_enums

ZERO3_RUN = "zero3_run"
"""Set (true) in a model spec (``launchers.trial.run.model_dict``) to trace the model as a ZeRO-3 run holds it:
DeepSpeed's linear keeping every Linear's input (``launchers/models/zero3_linear.py``), PEFT's adapters in
their own dtype. Only a model that trains in part differs (a full fine-tune's Linears keep their inputs anyway),
so only its ZeRO-3 candidates ask."""
ADAPTERS_CAST = "adapters_cast"
"""Set (true) beside :data:`ZERO3_RUN` where the engine casts PEFT's adapters to the training dtype at ZeRO-3 (a model
zero.Init did not build, a 4-bit base: ``optimizer.study.constraints.zero3_keeps_adapters_fp32`` false); unset,
a ZeRO-3 trace keeps them fp32, as ``get_peft_model`` made them."""
CPU_KERNELS = "cpu_kernels"
"""Set (true) in a model spec to trace the model as CPU ranks run it: the CPU kernels' own temporaries are made in
the trace (``launchers/trace/cpu_kernels.py``). A study whose ``hardware.accelerator`` is ``cpu`` asks."""

@dataclass(frozen=True, kw_only=True, slots=True)
class TracedActivation:
    """Activation bytes of one (checkpointing, precision) as traced, at each micro-batch of the search space.

    Traced at every micro-batch the space holds, so the ledger's figure is the trace's, not a fit: the
    high-water mark is a maximum over moments of the step, each linear in b (Korthikanti et al. 2022 §4), so
    it is piecewise linear and a two-point fit under-estimates where the peak moves (measured: −4 % for
    gpt2-tiny, full checkpointing, b = 4 from b = 1, 2). Between or beyond traced micro-batches the two
    nearest points are joined linearly.
    """

    checkpointing: str
    """The granularity, as the search space spells it (``none``, ``full``, ``every_2``, ``selective``)."""
    precision: Precision
    """The training precision the model was traced in."""
    points: tuple[tuple[int, int], ...] = ()
    """(micro-batch, activation high-water mark in bytes), sorted by micro-batch."""
    peak_phase: str = "backward"
    """``forward`` or ``backward``: where the high-water mark was (at the largest micro-batch)."""
    failed_op: str | None = None
    """Set when the trace failed: the op (or error) that stopped it; the ledger then uses the formula."""
    joint_points: tuple[tuple[int, int, int], ...] = ()
    """(micro-batch, activations + temporaries, gradients made so far) at the moment their sum peaked: the
    phase-aware join of activations and autograd's gradients (:mod:`launchers.trace.tracer`); empty when not traced."""
    split_points: tuple[tuple[int, int, int], ...] = ()
    """(micro-batch, activations' high-water mark before autograd made any gradient, … once one exists): the
    moments ZeRO-2's gradient bucket and partition are not yet live, and those they are (:mod:`launchers.trace.tracer`);
    empty when not traced."""
    notes: tuple[str, ...] = ()
    """What the trace assumed or how it was taken (MoE experts, depths extended), stated in the ledger."""
    zero3_gathered: int = 0
    """The most parameter elements ZeRO-3 keeps gathered at once, DeepSpeed's coordinator replayed over the
    traced module order (:mod:`optimizer.deepspeed.zero3_gather`); 0 when not traced."""
    zero3_joint_points: tuple[tuple[int, int, int, int, int], ...] = ()
    """(micro-batch, activations + temporaries, bytes of parameters ZeRO-3 holds gathered, bytes of released
    parameters autograd still holds — 4-bit weights bitsandbytes' matmul kept, :mod:`optimizer.deepspeed.zero3_gather`
    —, bytes a frozen reference copy's own coordinator holds gathered) at the moment their sum peaked
    (:attr:`launchers.trace.tracer.TraceResult.zero3_joint_segments`); empty when not traced."""
    zero3_autograd_held: int = 0
    """Bytes of the 4-bit weights bitsandbytes' matmul keeps for backward, whatever ZeRO-3 releases
    (:attr:`launchers.trace.tracer.TraceResult.zero3_autograd_held_bytes`); 0 when none or not traced."""
    zero3_run: bool = False
    """Traced as a ZeRO-3 run holds the model (``launchers.trace.tracer.ZERO3_RUN``: DeepSpeed's linear keeps every
    Linear's input, the adapters stay in their own dtype) — a model that trains in part, for its ZeRO-3
    candidates."""

    def __post_init__(self) -> None:
        coerce_enums(self, precision=Precision)
        object.__setattr__(self, "points", tuple(sorted((int(b), int(n)) for b, n in self.points)))
        object.__setattr__(self, "joint_points",
                           tuple(sorted((int(b), int(w), int(g)) for b, w, g in self.joint_points)))
        object.__setattr__(self, "split_points",
                           tuple(sorted((int(b), int(u), int(g)) for b, u, g in self.split_points)))
        object.__setattr__(self, "zero3_joint_points",
                           tuple(sorted((int(b), int(w), int(g), int(k), int(r))
                                        for b, w, g, k, r in self.zero3_joint_points)))
        object.__setattr__(self, "notes", tuple(str(n) for n in self.notes))
        if self.failed_op is None and not self.points:
            raise ValueError("a traced activation needs at least one (micro-batch, bytes) point")

    def bytes_at(self, micro_batch: int) -> int:
        """Activation high-water mark at ``micro_batch`` samples: traced, or joined from the nearest two."""
        return _joined(self.points, micro_batch)

    def joint_at(self, micro_batch: int) -> tuple[int, int] | None:
        """(activations, gradients so far) at the joint peak for ``micro_batch`` samples, as :meth:`bytes_at`
        joins points; None without joint points."""
        if not self.joint_points:
            return None
        working = _joined(tuple((b, w) for b, w, _ in self.joint_points), micro_batch)
        grads = _joined(tuple((b, g) for b, _, g in self.joint_points), micro_batch)
        return working, grads


    def split_at(self, micro_batch: int) -> tuple[int, int] | None:
        """(activations before the first gradient, activations after it) for ``micro_batch`` samples, as
        :meth:`bytes_at` joins points; None without split points."""
        if not self.split_points:
            return None
        return (_joined(tuple((b, u) for b, u, _ in self.split_points), micro_batch),
                _joined(tuple((b, g) for b, _, g in self.split_points), micro_batch))

    def zero3_joint_at(self, micro_batch: int) -> tuple[int, int, int, int] | None:
        """(activations, gathered parameter bytes, autograd's copies, a reference copy's gathered bytes) where their
        sum peaks for ``micro_batch`` samples, as :meth:`bytes_at` joins points; None without ZeRO-3 joint points."""
        if not self.zero3_joint_points:
            return None
        return tuple(_joined(tuple((point[0], point[i]) for point in self.zero3_joint_points), micro_batch)
                     for i in (1, 2, 3, 4))  # type: ignore[return-value]

def _joined(points: tuple[tuple[int, int], ...], micro_batch: int) -> int:
    """The value at ``micro_batch``: a traced point's, else the line through the nearest two (one point: in
    proportion to the micro-batch)."""
    exact = dict(points)
    if micro_batch in exact:
        return exact[micro_batch]
    if len(points) == 1:
        b, n = points[0]
        return -(-n * micro_batch // b)
    below = [p for p in points if p[0] < micro_batch]
    above = [p for p in points if p[0] > micro_batch]
    (b0, n0), (b1, n1) = (below[-1], above[0]) if below and above else \
        (points[-2], points[-1]) if below else (points[0], points[1])
    return max(0, round(n0 + (n1 - n0) * (micro_batch - b0) / (b1 - b0)))
