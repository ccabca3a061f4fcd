"""The ledger's activation lines: the formula, the trace, or the formula where the trace failed (pure).

Every line names its source, so a ledger never mixes traced and formula figures silently.
"""

from __future__ import annotations

from optimizer.ledger.items import Category, LedgerItem, Location, Phase
from optimizer.ledger.transformer import activation_estimate
from optimizer.study.knobs import Candidate
from optimizer.study.specs import ActivationSource, TransformerModel
from optimizer.study.traced_activation import TracedActivation

KORTHIKANTI = "Korthikanti et al. 2022 §4 (arXiv 2205.05198)"


def activation_source(items: list[LedgerItem] | tuple[LedgerItem, ...]) -> str:
    """Where the activation lines came from: ``trace``, ``formula``, ``formula (trace failed at OP)``,
    ``formula (not traced)`` or
    ``study`` — the part of their source before the colon."""
    kinds = sorted({i.source.split(":")[0] for i in items if i.category is Category.ACTIVATIONS})
    return " + ".join(kinds) or "none"


def usable_trace(model: TransformerModel, candidate: Candidate) -> TracedActivation | None:
    """The candidate's successful trace when the model asks for traces (``trace``/``auto``), else None."""
    traced = model.traced_for(candidate.checkpointing, candidate.precision,
                              zero3=candidate.zero_stage == 3) if model.wants_trace else None
    return traced if traced is not None and traced.failed_op is None else None


def joint_trace(model: TransformerModel, candidate: Candidate) -> TracedActivation | None:
    """The candidate's successful trace when it carries the joint of activations and gradients, else None."""
    traced = usable_trace(model, candidate)
    return traced if traced is not None and traced.joint_points else None


def activation_items(*, model: TransformerModel, candidate: Candidate, sequence_length: int,
                     element_bytes: int, joined: bool = False, split: bool = False,
                     zero3_joint: bool = False) -> list[LedgerItem]:
    """The activation lines, each saying where its figure came from.

    * ``activations: trace``/``auto`` with a traced entry: one line, the traced high-water mark of
      activations and temporaries over forward + backward (recomputed blocks and activation gradients
      included), scaled linearly in the micro-batch; source ``trace: …`` with what the trace assumed.
    * ``joined`` (the caller counts autograd's gradients after backward only, :mod:`optimizer.ledger.model_states`):
      two lines at the moment activations + the gradients made so far peaked, as traced — the activations
      then, and those gradients.
    * ``split`` (the caller's gradient storage appears at the first gradient, ZeRO-2): two lines, the traced
      high-water mark before autograd made any gradient (phase ``forward``) and after (``backward``).
    * ``zero3_joint`` (the caller counts ZeRO-3's gathered parameters at one traced moment): the activations at the
      moment they and the gathered parameters together peaked (:meth:`TracedActivation.zero3_joint_at`).
    * otherwise the formula's two lines (kept for backward, + one recomputed block); when the trace failed,
      the source says at which op, and an ``auto`` study not traced says so.
    """
    traced = model.traced_for(candidate.checkpointing, candidate.precision,
                              zero3=candidate.zero_stage == 3) if model.wants_trace else None
    if traced is not None and traced.failed_op is None:
        b = candidate.micro_batch_size
        how = f"traced at b = {b}" if b in dict(traced.points) else \
            f"joined from traces at b = {', '.join(str(p[0]) for p in traced.points)}"
        source = "; ".join([f"trace: the study's model on fake tensors ({candidate.precision})", *traced.notes])
        joint = traced.joint_at(b) if joined else None
        halves = traced.split_at(b) if split else None
        ckpt = candidate.checkpointing
        zero3 = traced.zero3_joint_at(b) if zero3_joint else None
        if zero3 is not None:
            lines = [(f"activations where they and ZeRO-3's gathered parameters peak ({ckpt})", Category.ACTIVATIONS,
                      zero3[0], Phase.BACKWARD)]
        elif joint is not None:
            lines = [(f"activations where activations + gradients peak ({ckpt})", Category.ACTIVATIONS, joint[0],
                      Phase.BACKWARD),
                     ("gradients made by that moment of backward", Category.GRADS, joint[1], Phase.BACKWARD)]
        elif halves is not None:
            lines = [(f"activations before the first gradient ({ckpt})", Category.ACTIVATIONS, halves[0],
                      Phase.FORWARD),
                     (f"activations once gradients exist ({ckpt})", Category.ACTIVATIONS, halves[1], Phase.BACKWARD)]
        else:
            lines = [(f"activations, traced high-water mark ({ckpt}, {traced.peak_phase})", Category.ACTIVATIONS,
                      traced.bytes_at(b), Phase.BACKWARD)]
        return [LedgerItem(name=name, category=category, location=Location.GPU, bytes=num_bytes, formula=how,
                           source=source, phase=phase) for name, category, num_bytes, phase in lines]
    if traced is not None:
        source = f"formula (trace failed at {traced.failed_op}): {KORTHIKANTI}"
    elif model.wants_trace:
        why = "not traced" if model.activations is ActivationSource.AUTO else "no trace for this granularity"
        source = f"formula ({why}): {KORTHIKANTI}"
    else:
        source = f"formula: {KORTHIKANTI}"
    act = activation_estimate(model, checkpointing=candidate.checkpointing, seq=sequence_length,
                              micro_batch=model.rows(candidate.micro_batch_size), element_bytes=element_bytes)
    items = [LedgerItem(name=f"activations kept for backward ({candidate.checkpointing})",
                        category=Category.ACTIVATIONS, location=Location.GPU, bytes=act.stored_bytes,
                        formula=act.formula.split(", +")[0], source=source, phase=Phase.BACKWARD)]
    if act.recompute_bytes:
        items.append(LedgerItem(name="recomputed block in backward", category=Category.ACTIVATIONS,
                                location=Location.GPU, bytes=act.recompute_bytes,
                                formula=act.formula.split(", + ")[1], source=source, phase=Phase.BACKWARD))
    return items
