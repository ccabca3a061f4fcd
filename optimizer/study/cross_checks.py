"""Checks across a study file's sections, run when the file is read (pure): what each section allows alone but
the study cannot run together."""

from __future__ import annotations

from optimizer.study.errors import UserError
from optimizer.study.specs import ModelSpec, PositionKind, TrainingSpec, TransformerModel


def check_positions(*, model: ModelSpec, training: TrainingSpec, source: str) -> None:
    """Refuse a sequence longer than a model's learned position table.

    A learned position embedding (GPT-2's ``wpe``, ``n_positions`` rows; dsopt's GPT, ``max_positions``) is an
    ``nn.Embedding`` looked up at positions 0 … s−1: position ``n_positions`` is out of range and the real run
    fails at its first forward (an index error on CPU ranks, a device-side assert on CUDA), while the ledger
    would price it as any other sequence. Rotary positions have no table — ``transformers`` computes the rotation
    for any position (``LlamaRotaryEmbedding.forward`` takes ``position_ids``), and dsopt's GPT applies none — so
    a longer sequence runs (past the context the model was trained for, which is the user's choice)."""
    if not isinstance(model, TransformerModel) or model.position_embedding is not PositionKind.LEARNED:
        return
    if training.sequence_length <= model.max_positions:
        return
    where = ("the transformers config's n_positions / max_position_embeddings" if model.hf_config
             else "model.max_positions")
    raise UserError(source=source, key="training.sequence_length",
                    why=f"{training.sequence_length:,} tokens is longer than the model's {model.max_positions:,} "
                        f"learned positions ({where}): the real run would fail at the position embedding; use "
                        f"sequence_length <= {model.max_positions:,} or a model with more positions")
