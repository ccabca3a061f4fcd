"""Which of a model's decoder blocks there are and which checkpointing recomputes — shared by the built-in GPT
(:mod:`launchers.models.builtin`), the transformers models (:mod:`launchers.models.hf_model`) and the tracer."""

from __future__ import annotations

from torch import nn


def recomputed_blocks(checkpointing: str, layers: int) -> set[int]:
    """0-based indices of the blocks recomputed in backward (``full``, ``every_K``; none otherwise)."""
    if checkpointing == "full":
        return set(range(layers))
    if checkpointing.startswith("every_"):
        k = int(checkpointing.removeprefix("every_"))
        return {i for i in range(layers) if (i + 1) % k == 0}
    return set()


def decoder_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The decoder blocks: the model's first non-empty ``ModuleList`` (``layers`` in the built-in GPT,
    ``model.layers`` in transformers' Llama and Mistral), or None."""
    return next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)), None)
