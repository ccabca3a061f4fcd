"""The ledger's activation lines: the formula, the trace, or the formula where the trace failed (pure).

Every line names its source, so a ledger never mixes traced and formula figures silently (issue 7).
"""

from __future__ import annotations

from optimizer.knobs import Candidate
from optimizer.ledger_items import Category, LedgerItem, Location, Phase
from optimizer.specs import ActivationSource, TransformerModel
from optimizer.transformer import activation_estimate

KORTHIKANTI = "Korthikanti et al. 2022 §4 (arXiv 2205.05198)"


def activation_source(items: list[LedgerItem] | tuple[LedgerItem, ...]) -> str:
    """Where the activation lines came from: ``trace``, ``formula``, ``formula (trace failed at OP)`` or
    ``study`` — the part of their source before the colon."""
    kinds = sorted({i.source.split(":")[0] for i in items if i.category is Category.ACTIVATIONS})
    return " + ".join(kinds) or "none"


def activation_items(*, model: TransformerModel, candidate: Candidate, sequence_length: int,
                     element_bytes: int) -> list[LedgerItem]:
    """The activation lines, each saying where its figure came from.

    * ``activations: trace`` with a traced entry: one line, the traced high-water mark of activations and
      temporaries over forward + backward (recomputed blocks and activation gradients included), scaled
      linearly in the micro-batch; source ``trace (...)``.
    * otherwise the formula's two lines (kept for backward, + one recomputed block); when the trace failed,
      the source says at which op.
    """
    traced = model.traced_for(candidate.checkpointing, candidate.precision) \
        if model.activations is ActivationSource.TRACE else None
    if traced is not None and traced.failed_op is None:
        b = candidate.micro_batch_size
        return [LedgerItem(
            name=f"activations, traced high-water mark ({candidate.checkpointing}, {traced.peak_phase})",
            category=Category.ACTIVATIONS, location=Location.GPU, bytes=traced.bytes_at(b),
            formula=f"traced at b = {b}" if b in dict(traced.points) else
            f"joined from traces at b = {', '.join(str(p[0]) for p in traced.points)}",
            source=f"trace: the study's model on fake tensors ({candidate.precision})",
            phase=Phase.BACKWARD)]
    if model.activations is ActivationSource.TRACE:
        why = f"failed at {traced.failed_op}" if traced is not None else "no trace for this granularity"
        source = f"formula (trace {why}): {KORTHIKANTI}"
    else:
        source = f"formula: {KORTHIKANTI}"
    act = activation_estimate(model, checkpointing=candidate.checkpointing, seq=sequence_length,
                              micro_batch=candidate.micro_batch_size, element_bytes=element_bytes)
    items = [LedgerItem(name=f"activations kept for backward ({candidate.checkpointing})",
                        category=Category.ACTIVATIONS, location=Location.GPU, bytes=act.stored_bytes,
                        formula=act.formula.split(", +")[0], source=source, phase=Phase.BACKWARD)]
    if act.recompute_bytes:
        items.append(LedgerItem(name="recomputed block in backward", category=Category.ACTIVATIONS,
                                location=Location.GPU, bytes=act.recompute_bytes,
                                formula=act.formula.split(", + ")[1], source=source, phase=Phase.BACKWARD))
    return items
