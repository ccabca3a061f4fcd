"""A Hugging Face ``transformers`` config (a local dict or ``config.json``) as the ledger's model shape (pure).

The ledger needs the shape (layers, widths, heads, vocabulary) and the block's kind (SwiGLU, RMSNorm, GQA,
biases, dropout); trials and traces build the real ``transformers`` class from the same dict
(:mod:`launchers.models.hf_model`). Nothing is downloaded and ``transformers`` is not imported here.

Read here, without transformers: ``llama`` and ``mistral`` (``LlamaConfig``/``MistralConfig`` in transformers:
pre-norm RMSNorm blocks, SwiGLU MLP of ``intermediate_size``, rotary positions, grouped-query attention with
``num_key_value_heads``) — the block the ledger's formulas describe exactly. The keys a real config.json always
carries are required; the optional ones take transformers' defaults (``num_key_value_heads`` = heads,
``tie_word_embeddings`` false, ``attention_bias``, ``mlp_bias`` false, ``attention_dropout`` 0), as documented in
``configuration_llama.py``.

**Any other causal-LM ``model_type`` the installed transformers knows** (gpt2, qwen2, gemma, phi3, mixtral, ...)
is read through transformers' own config class (``AutoConfig.for_model``, which maps each family's names —
``n_layer``, ``n_embd``, ``ffn_dim`` — onto the common ones) by :func:`generic_shape`; an unknown type, or one
with no ``AutoModelForCausalLM`` class, is one error naming the type and the transformers version. Its
parameters are then counted from the model itself (:mod:`optimizer.study.inventory`), exactly; the shape's block
kind (gated MLP or not, the norm, learned or rotary positions) is the family's, from :data:`CLASSIC_FAMILIES`,
and only the activation *formula* uses it — the trace (``activations: trace``) measures the real block.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from optimizer.study import limits
from optimizer.study.errors import error_summary

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
"""Read without transformers; every other causal-LM type through it (:func:`generic_shape`)."""

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
    """The :class:`optimizer.study.specs.TransformerModel` fields (without ``attention``) a config describes.

    Raises :class:`HfConfigError` naming the key for a missing key, an unsupported ``model_type``, or a layout
    the ledger cannot describe (an explicit ``head_dim`` other than hidden/heads, different attention and MLP
    biases).
    """
    if "model_type" not in config:
        raise HfConfigError("model_type", "missing (a transformers config.json always has it)")
    if not isinstance(config["model_type"], str):
        raise HfConfigError("model_type", f"expected a string, got {config['model_type']!r}")
    if config["model_type"] in SUPPORTED_MODEL_TYPES:
        for key in REQUIRED_KEYS:
            if key not in config:
                raise HfConfigError(key, "missing (a transformers config.json always has it)")
    model_type = config["model_type"]
    if model_type not in SUPPORTED_MODEL_TYPES:
        return generic_shape(config)
    ints = {key: config[key] for key in REQUIRED_KEYS[1:]}
    for key, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HfConfigError(key, f"expected a positive integer, got {value!r}")
    for key in ("num_key_value_heads", "max_position_embeddings"):  # optional, but never 0 or text when given
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise HfConfigError(key, f"expected a positive integer, got {value!r}")
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):  # bool("false") would be True
        if key in config and not isinstance(config[key], bool):
            raise HfConfigError(key, f"expected true or false, got {config[key]!r}")
    dropout = config.get("attention_dropout", 0.0)
    if dropout is not None and (isinstance(dropout, bool) or not isinstance(dropout, (int, float))):
        raise HfConfigError("attention_dropout", f"expected a number, got {dropout!r}")
    hidden, heads = ints["hidden_size"], ints["num_attention_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and hidden % heads == 0 and head_dim != hidden // heads:
        raise HfConfigError("head_dim", f"{head_dim} differs from hidden_size/num_attention_heads = "
                            f"{hidden // heads}; the ledger's attention terms assume they are equal")
    attention_bias, mlp_bias = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise HfConfigError("mlp_bias", "the ledger assumes attention and MLP biases are both on or both off")
    if head_dim is None and hidden % heads:
        raise HfConfigError("num_attention_heads", f"{heads} does not divide hidden_size {hidden}")
    kv = config.get("num_key_value_heads") or heads
    if kv > heads or heads % kv:
        raise HfConfigError("num_key_value_heads", f"{kv} key/value heads do not divide {heads} heads")
    shape = {
        "layers": ints["num_hidden_layers"],
        "hidden_size": hidden,
        "heads": heads,
        "kv_heads": kv,
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
    return within_limits(shape, key_of=lambda name: LLAMA_KEYS.get(name, name))


LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")
"""Where families keep the layer count in config.json (transformers maps them onto ``num_hidden_layers``)."""
LLAMA_KEYS = {"layers": "num_hidden_layers", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
              "ffn_size": "intermediate_size", "max_positions": "max_position_embeddings"}
"""The shape's field → the config key (Llama's names) it is read from."""


def within_limits(shape: dict[str, Any], *, key_of: Callable[[str], str]) -> dict[str, Any]:
    """``shape`` unchanged, or HfConfigError naming the config's key of a count beyond any real model
    (:mod:`optimizer.study.limits`) — checked before anything is built."""
    for name, (limit, what) in limits.MODEL_LIMITS.items():
        if why := limits.beyond(shape[name], limit, what):
            raise HfConfigError(key_of(name), why)
    return shape


CLASSIC_FAMILIES = frozenset({"gpt2", "gpt_neo", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon",
                              "codegen", "phi", "mpt", "biogpt", "xglm", "starcoder2"})
"""Families whose block is GPT-2's kind: a two-matrix GELU MLP, LayerNorm, biases. Every other family is taken
as Llama's kind (gated MLP, RMSNorm, no biases). Only the activation formula reads this."""
LEARNED_POSITIONS = frozenset({"gpt2", "gpt_neo", "gpt_bigcode", "opt", "biogpt", "xglm"})
"""Families with a learned absolute position table (the others: rotary or ALiBi, no parameters)."""
FFN_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff")
"""Where families keep the MLP width (transformers has no common name for it); none set: 4h, as GPT-2."""
KV_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "resid_pdrop", "hidden_dropout", "dropout", "attn_dropout")


def generic_shape(config: Mapping[str, Any]) -> dict[str, Any]:
    """The shape fields of a causal-LM config of any family the installed transformers knows (module doc).

    HfConfigError naming the key: transformers missing, an unknown ``model_type``, one without a causal-LM
    class, a config transformers refuses, or widths the ledger cannot hold (non-positive, heads not dividing
    the width)."""
    model_type = config["model_type"]
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        raise HfConfigError("model_type", f"{model_type!r} is read through transformers, which is not installed: "
                            "pip install 'dsopt[hf]' (llama and mistral are read without it)") from None
    version = transformers.__version__
    if model_type not in transformers.CONFIG_MAPPING:
        raise HfConfigError("model_type", f"{model_type!r} is not a model type transformers {version} knows")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HfConfigError("model_type", f"{model_type!r} has no causal-LM model (AutoModelForCausalLM) in "
                            f"transformers {version}")
    for key in LAYER_KEYS:  # before transformers builds per-layer lists (layer_types) of that length
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > limits.MAX_LAYERS:
            within_limits({**dict.fromkeys(limits.MODEL_LIMITS, 0), "layers": value}, key_of=lambda _name, key=key: key)
    settings = {k: v for k, v in config.items() if k != "model_type"}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its token-id remarks are not the user's problem here
    try:
        hf = transformers.AutoConfig.for_model(model_type, **settings)
    except Exception as err:  # transformers' own validation: one line, the config named by the caller
        raise HfConfigError("model_type", f"transformers {version} refuses this {model_type} config: "
                            f"{type(err).__name__}: {error_summary(err)}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    aliases = {**getattr(hf, "attribute_map", {}), **getattr(text, "attribute_map", {})}

    def spelled(name: str) -> str:
        """The config's own key for transformers' common ``name`` (GPT-2's ``n_embd`` for ``hidden_size``)."""
        alias = aliases.get(name)
        return alias if alias and alias in config and name not in config else name

    def whole(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HfConfigError(spelled(name), f"expected a positive integer, got {value!r}")
        return value

    hidden = whole("hidden_size", getattr(text, "hidden_size", None))
    if not getattr(text, "num_attention_heads", None) and "num_attention_heads" not in config:
        raise HfConfigError("model_type", f"{model_type!r} has no attention heads (a state-space or recurrent "
                            "model): the ledger's activation and ZeRO-3 formulas describe attention transformers")
    heads = whole("num_attention_heads", getattr(text, "num_attention_heads", None))
    if hidden % heads:
        raise HfConfigError(spelled("num_attention_heads"), f"{heads} does not divide {spelled('hidden_size')} "
                            f"{hidden}")
    kv_key = next((k for k in KV_KEYS if getattr(text, k, None) is not None), None)  # 0 is an error, not unset
    kv = whole(kv_key, getattr(text, kv_key)) if kv_key else (1 if getattr(text, "multi_query", False) else heads)
    if heads % kv:
        raise HfConfigError(spelled(kv_key or "num_attention_heads"), f"{kv} key/value heads do not divide {heads} "
                            "heads")
    ffn_key = next((k for k in FFN_KEYS if getattr(text, k, None) is not None), None)
    classic = model_type in CLASSIC_FAMILIES
    dropout = any(isinstance(getattr(text, k, None), (int, float)) and getattr(text, k) > 0 for k in DROPOUT_KEYS)
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
        if "max_position_embeddings" in config or "n_positions" in config:  # the user's own value: refuse it
            raise HfConfigError("max_position_embeddings", f"expected a positive integer, got {positions!r}")
        positions = 2048  # the class has no position table (XLNet's -1): rotary or relative positions
    shape = {
        "layers": whole("num_hidden_layers", getattr(text, "num_hidden_layers", None)),
        "hidden_size": hidden,
        "heads": heads,
        "kv_heads": kv,
        "ffn_size": whole(ffn_key, getattr(text, ffn_key)) if ffn_key else 4 * hidden,
        "vocab_size": whole("vocab_size", getattr(text, "vocab_size", None)),
        "tied_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
        "mlp": "gelu" if classic else "swiglu",
        "norm": "layernorm" if classic else "rmsnorm",
        "bias": classic,
        "position_embedding": "learned" if model_type in LEARNED_POSITIONS else "rope",
        "dropout": dropout,
        "max_positions": whole("max_position_embeddings", positions),
    }
    common = {"layers": "num_hidden_layers", "heads": "num_attention_heads",
              "kv_heads": kv_key or "num_attention_heads", "ffn_size": ffn_key or "hidden_size",
              "max_positions": "max_position_embeddings"}
    return within_limits(shape, key_of=lambda name: spelled(common.get(name, name)))
