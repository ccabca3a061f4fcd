"""A Hugging Face ``transformers`` config (a local dict or ``config.json``) as the ledger's model shape (pure).

The ledger needs the shape (layers, widths, heads, vocabulary) and the block's kind (SwiGLU, RMSNorm, GQA,
biases, dropout); trials and traces build the real ``transformers`` class from the same dict
(:mod:`launchers.hf_model`). Nothing is downloaded and ``transformers`` is not imported here.

Supported ``model_type``: ``llama`` and ``mistral`` (``LlamaConfig``/``MistralConfig`` in transformers:
pre-norm RMSNorm blocks, SwiGLU MLP of ``intermediate_size``, rotary positions, grouped-query attention with
``num_key_value_heads``). The keys a real config.json always carries are required; the optional ones take
transformers' defaults (``num_key_value_heads`` = heads, ``tie_word_embeddings`` false, ``attention_bias``,
``mlp_bias`` false, ``attention_dropout`` 0), as documented in ``configuration_llama.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral")

REQUIRED_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads")


class HfConfigError(ValueError):
    """The config cannot be used; ``key`` names the offending key."""

    def __init__(self, key: str, why: str) -> None:
        self.key = key
        super().__init__(f"{key}: {why}")


def canonical_json(config: Mapping[str, Any]) -> str:
    """The config as sorted, compact JSON: hashable, and the trace cache's key."""
    return json.dumps(dict(config), sort_keys=True, separators=(",", ":"))


def shape_from_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`optimizer.specs.TransformerModel` fields (without ``attention``) a config describes.

    Raises :class:`HfConfigError` naming the key for a missing key, an unsupported ``model_type``, or a layout
    the ledger cannot describe (an explicit ``head_dim`` other than hidden/heads, different attention and MLP
    biases).
    """
    for key in REQUIRED_KEYS:
        if key not in config:
            raise HfConfigError(key, "missing (a transformers config.json always has it)")
    model_type = config["model_type"]
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HfConfigError("model_type", f"{model_type!r} is not supported; supported: "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    ints = {key: config[key] for key in REQUIRED_KEYS[1:]}
    for key, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HfConfigError(key, f"expected a positive integer, got {value!r}")
    hidden, heads = ints["hidden_size"], ints["num_attention_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and hidden % heads == 0 and head_dim != hidden // heads:
        raise HfConfigError("head_dim", f"{head_dim} differs from hidden_size/num_attention_heads = "
                            f"{hidden // heads}; the ledger's attention terms assume they are equal")
    attention_bias, mlp_bias = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise HfConfigError("mlp_bias", "the ledger assumes attention and MLP biases are both on or both off")
    return {
        "layers": ints["num_hidden_layers"],
        "hidden_size": hidden,
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads") or heads,
        "ffn_size": ints["intermediate_size"],
        "vocab_size": ints["vocab_size"],
        "tied_embeddings": bool(config.get("tie_word_embeddings", False)),
        "mlp": "swiglu",
        "norm": "rmsnorm",
        "bias": attention_bias,
        "position_embedding": "rope",
        "dropout": float(config.get("attention_dropout", 0.0) or 0.0) > 0.0,
        "max_positions": config.get("max_position_embeddings") or 2048,
    }
