"""A Hugging Face ``transformers`` causal LM built from the study's local config (no downloads).

The config dict (``model.hf_config`` in the study, see :mod:`optimizer.study.hf_config`) becomes
``AutoConfig.for_model(model_type, **config)`` and ``AutoModelForCausalLM.from_config`` — random weights, the
library's own modules (its RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query attention). Attention is
``eager`` or ``sdpa`` as the study's ``model.attention`` says (eager / fused). Checkpointing uses the
library's own ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before 5.x),
non-reentrant; ``every_K`` then switches it off on the blocks that are not recomputed (each decoder layer is
a ``GradientCheckpointingLayer`` with its own flag, transformers >= 4.53). ``transformers`` has no
selective recompute; the constraints mark such candidates invalid.

The wrapper's ``forward(tokens)`` returns the same next-token cross-entropy as the built-in GPT (inputs
``tokens[:, :-1]``, targets ``tokens[:, 1:]``, FP32 logits), so the synthetic data and the loss-fidelity
check are shared. With ``model.lm_head: trl_fused`` the model gets TRL's fused head
(``trl.trainer.utils.add_fused_lm_head``, as TRL 1.16's trainers add it) and the same mean negative log-likelihood
comes from ``forward(input_ids=inputs, labels=inputs, fused_lm_head=True).loss`` as TRL's trainers call it (the
head shifts the labels: s inputs, s − 1 scored positions) — TRL's ``ChunkedLogProbFunction``, its tiles and no
logits (where Triton runs it scores only the labelled positions; everywhere else, and here, all).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from launchers.models.blocks import decoder_blocks, recomputed_blocks

ATTENTION = {"eager": "eager", "fused": "sdpa"}


class HfCausalLM(nn.Module):
    """A ``transformers`` causal LM whose ``forward(tokens)`` returns the scalar loss."""

    def __init__(self, inner: nn.Module, *, fused_head: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.fused_head = fused_head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.fused_head:  # TRL's head (module doc), as TRL's trainers call it: labels = the inputs, shifted
            inputs = tokens[:, :-1]  # inside, so the s inputs score s − 1 positions (the last target goes unused)
            return self.inner(input_ids=inputs, labels=inputs, use_cache=False, fused_lm_head=True).loss
        logits = self.inner(input_ids=tokens[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def build_hf_model(config: dict[str, Any], *, attention: str, checkpointing: str, dtype: torch.dtype,
                   lm_head: str = "logits") -> HfCausalLM:
    """The model of ``config`` with random weights in ``dtype`` (the config's own ``torch_dtype``/``dtype`` is
    overridden: a Llama-2 config says float16 even for an FP32 run), checkpointed as ``checkpointing`` says, with
    TRL's fused head where ``lm_head`` is ``trl_fused`` (module doc).
    Under an ``HfDeepSpeedConfig`` of stage 3 the library builds it under ``deepspeed.zero.Init``."""
    try:
        import transformers
    except ImportError as err:
        raise RuntimeError("model.hf_config needs the transformers package: pip install 'dsopt[hf]'") from err
    settings = dict(config)
    model_type = settings.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **settings)
    inner = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation=ATTENTION[attention],
                                                          dtype=dtype)
    if checkpointing == "selective":
        raise ValueError("transformers models have no selective recompute")
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config  # Llama 4
    recompute = recomputed_blocks(checkpointing, text_config.num_hidden_layers)
    if recompute:
        kwargs = {"use_reentrant": False}
        if hasattr(inner, "activation_checkpointing_enable"):  # transformers >= 5.x; the older name warns
            inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        for index, layer in enumerate(decoder_blocks(inner) or ()):
            if not hasattr(layer, "gradient_checkpointing"):  # before GradientCheckpointingLayer (4.53)
                raise RuntimeError(f"{type(layer).__name__} has no per-layer checkpointing flag; upgrade transformers")
            layer.gradient_checkpointing = index in recompute
    if lm_head == "trl_fused":
        try:
            from trl.trainer.utils import add_fused_lm_head
        except ImportError as err:
            raise RuntimeError("model.lm_head: trl_fused needs the trl package: pip install trl") from err
        add_fused_lm_head(inner)  # before PEFT wraps the model, as TRL's trainers add it
    inner.train()
    return HfCausalLM(inner, fused_head=lm_head == "trl_fused")

