"""The built-in workload: a GPT-style decoder in plain torch and deterministic synthetic tokens.

The model's layout is the one :func:`optimizer.ledger.transformer.parameter_tensors` describes (so the ledger's
parameter count is the model's), its shape comes from the study's transformer-mode spec, and
activation checkpointing is applied here with ``torch.utils.checkpoint`` according to the candidate
(DeepSpeed's ``activation_checkpointing`` JSON section alone turns nothing on):

* ``full``: every block is recomputed; ``every_K``: blocks K, 2K, … (counted from 1);
* ``selective``: only the attention core (scores, softmax, dropout, ·V) is recomputed.

Data: token sequences from a fixed affine Markov chain, ``x[t+1] = (a·x[t] + c) mod V``, with 10 % of the
tokens replaced at random — learnable, so the loss falls and loss fidelity is meaningful. Sample ``i``
of optimizer step ``k`` depends only on ``(seed, k, i)``: every trial of a study sees the same batches,
whatever its micro-batch or rank count.

Rotary position embeddings carry no parameters and are not applied here (a ``rope`` model attends without
positional signal): the workload measures memory, speed and numerical agreement, not model quality.

A Hugging Face ``transformers`` config (``model.hf_config``) builds that library's model instead of the
built-in GPT (:mod:`launchers.models.hf_model`), on the same synthetic data.

A user's own model plugs in with ``model.entry_point: "module:function"`` in the study file. The function
is called as ``function(model_spec: dict, sequence_length: int, seed: int, checkpointing: str)`` and
returns
``(model, batch_fn)``: ``model`` is an ``nn.Module`` whose ``forward(batch)`` returns the scalar loss,
and ``batch_fn(step: int, sample_indices: list[int]) -> batch`` builds the batch for those global
sample indices of that optimizer step (tensors on the CPU; the rank program moves them).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from launchers.models.blocks import recomputed_blocks
from launchers.models.construction import GPT_INIT_STD, construction_context, seeded_init_, training_dtype

DROPOUT_P = 0.1
"""Dropout probability when the model spec has ``dropout: true``."""
NOISE_FRACTION = 0.1
"""Share of tokens replaced at random in the synthetic data."""

BatchFn = Callable[[int, Sequence[int]], Any]


def _norm(kind: str, h: int) -> nn.Module:
    return nn.LayerNorm(h) if kind == "layernorm" else nn.RMSNorm(h)


class Attention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention; eager materialises the s×s scores."""

    def __init__(self, spec: dict[str, Any], *, selective: bool) -> None:
        super().__init__()
        h, heads, kv = spec["hidden_size"], spec["heads"], spec["kv_heads"]
        self.heads, self.kv_heads, self.head_dim = heads, kv, h // heads
        bias = spec["bias"]
        self.q = nn.Linear(h, h, bias=bias)
        self.k = nn.Linear(h, kv * self.head_dim, bias=bias)
        self.v = nn.Linear(h, kv * self.head_dim, bias=bias)
        self.o = nn.Linear(h, h, bias=bias)
        self.eager = spec["attention"] == "eager"
        self.dropout_p = DROPOUT_P if spec["dropout"] else 0.0
        self.selective = selective

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QKᵀ/√d)·V, causal — the part selective checkpointing recomputes."""
        p = self.dropout_p if self.training else 0.0
        if not self.eager:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p,
                                                  enable_gqa=self.kv_heads != self.heads)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        s = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = F.dropout(scores.masked_fill(mask, float("-inf")).softmax(dim=-1), p=p)
        return probs @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        out = checkpoint(self.core, q, k, v, use_reentrant=False) if self.selective else self.core(q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, s, h))


class Mlp(nn.Module):
    """GPT-2's GELU MLP (fc, proj) or Llama's SwiGLU (gate, up, down)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        h, f, bias = spec["hidden_size"], spec["ffn_size"], spec["bias"]
        self.swiglu = spec["mlp"] == "swiglu"
        if self.swiglu:
            self.gate, self.up, self.down = nn.Linear(h, f, bias=bias), nn.Linear(h, f, bias=bias), nn.Linear(
                f, h, bias=bias)
        else:
            self.fc, self.proj = nn.Linear(h, f, bias=bias), nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)); x + mlp(norm2(x)), with dropout on each branch."""

    def __init__(self, spec: dict[str, Any], *, selective: bool) -> None:
        super().__init__()
        self.norm1 = _norm(spec["norm"], spec["hidden_size"])
        self.attn = Attention(spec, selective=selective)
        self.norm2 = _norm(spec["norm"], spec["hidden_size"])
        self.mlp = Mlp(spec)
        self.drop = nn.Dropout(DROPOUT_P) if spec["dropout"] else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """A decoder-only transformer whose ``forward(tokens)`` returns the next-token cross-entropy."""

    def __init__(self, spec: dict[str, Any], *, checkpointing: str) -> None:
        super().__init__()
        h, vocab = spec["hidden_size"], spec["vocab_size"]
        self.embed_tokens = nn.Embedding(vocab, h)
        self.embed_positions = nn.Embedding(spec["max_positions"], h) if spec["position_embedding"] == "learned" \
            else None
        self.embed_drop = nn.Dropout(DROPOUT_P) if spec["dropout"] else nn.Identity()
        self.layers = nn.ModuleList(Block(spec, selective=checkpointing == "selective")
                                    for _ in range(spec["layers"]))
        self.final_norm = _norm(spec["norm"], h)
        self.lm_head = None if spec["tied_embeddings"] else nn.Linear(h, vocab, bias=False)
        self.recompute = recomputed_blocks(checkpointing, spec["layers"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.embed_tokens(inputs)
        if self.embed_positions is not None:
            x = x + self.embed_positions(torch.arange(inputs.shape[1], device=inputs.device))
        x = self.embed_drop(x)
        for index, block in enumerate(self.layers):
            x = checkpoint(block, x, use_reentrant=False) if index in self.recompute else block(x)
        x = self.final_norm(x)
        logits = self.lm_head(x) if self.lm_head is not None else x @ self.embed_tokens.weight.t()
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class SyntheticTokens:
    """Deterministic, learnable token sequences: sample ``i`` of step ``k`` depends only on ``(seed, k, i)``."""

    def __init__(self, *, vocab_size: int, sequence_length: int, seed: int) -> None:
        self.vocab, self.length, self.seed = vocab_size, sequence_length, seed
        rule = torch.Generator().manual_seed(seed)
        self.a = int(torch.randint(1, vocab_size, (1,), generator=rule)) | 1
        self.c = int(torch.randint(0, vocab_size, (1,), generator=rule))

    def sample(self, step: int, index: int) -> torch.Tensor:
        """``sequence_length + 1`` tokens (inputs and shifted targets)."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1_000_003 + index)
        first = int(torch.randint(0, self.vocab, (1,), generator=gen))
        noise = (torch.rand(self.length + 1, generator=gen) < NOISE_FRACTION).tolist()
        random_tokens = torch.randint(0, self.vocab, (self.length + 1,), generator=gen).tolist()
        tokens = [first]
        for t in range(1, self.length + 1):  # Python ints: element writes into a tensor cost ~1 µs each
            tokens.append(random_tokens[t] if noise[t] else (self.a * tokens[-1] + self.c) % self.vocab)
        return torch.tensor(tokens, dtype=torch.long)

    def __call__(self, step: int, sample_indices: Sequence[int]) -> torch.Tensor:
        return torch.stack([self.sample(step, i) for i in sample_indices])


def load_entry_point(entry_point: str) -> Callable[..., tuple[nn.Module, BatchFn]]:
    """Import ``module:function``."""
    module_name, sep, function_name = entry_point.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"entry point must look like 'module:function', got {entry_point!r}")
    return getattr(importlib.import_module(module_name), function_name)


def build_model(model_spec: dict[str, Any], *, checkpointing: str, dtype: torch.dtype | None = None) -> nn.Module:
    """The built-in GPT, or the ``transformers`` model of ``model_spec["hf_config"]``
    (:mod:`launchers.models.hf_model`)
    built in ``dtype`` (default: the current default dtype) whatever the config's own ``torch_dtype`` says.
    Weights as the constructors leave them: :func:`build_workload` seeds them."""
    if model_spec.get("hf_config"):
        from launchers.models.hf_model import build_hf_model

        return build_hf_model(model_spec["hf_config"], attention=model_spec["attention"], checkpointing=checkpointing,
                              dtype=dtype or torch.get_default_dtype(), lm_head=model_spec.get("lm_head", "logits"))
    return GPT(model_spec, checkpointing=checkpointing)


def init_std(model_spec: dict[str, Any]) -> float:
    """The weights' standard deviation: the transformers config's ``initializer_range``, else GPT-2's 0.02."""
    config = model_spec.get("hf_config") or {}
    return float(config.get("initializer_range", GPT_INIT_STD))


def build_workload(*, model_spec: dict[str, Any], checkpointing: str, sequence_length: int, seed: int,
                   entry_point: str | None, construction: str = "full", ds_config: dict[str, Any] | None = None,
                   device: torch.device | None = None) -> tuple[nn.Module, BatchFn]:
    """The model and its batch function — the built-in GPT, a transformers model or the study's entry point —
    built as ``construction`` says (:mod:`launchers.models.construction`; ``ds_config`` is the trial's DeepSpeed
    config, ``device`` the rank's device). ``full`` adds no context, so an entry point that calls this for its
    inner model inherits the construction dsopt entered around it."""
    torch.manual_seed(seed)
    config = ds_config or {}
    device = device or torch.device("cpu")
    hf = bool(model_spec.get("hf_config"))
    from launchers.models.trainable import apply_trainable, zero_lora_b_

    # A 4-bit base is built on the host and each 4-bit layer quantized onto the device (quantize_ below), as
    # from_pretrained(quantization_config=...) loads it: the device never holds the 16-bit base (a 70B model's
    # 140 GB); on CPU ranks host and device are one memory, and nothing changes.
    four_bit = bool(model_spec.get("quantization")) and not entry_point
    build_device = torch.device("cpu") if four_bit else device
    with construction_context(construction, ds_config=config, device=build_device, hf=hf and not entry_point):
        if entry_point:
            model, batch_fn = load_entry_point(entry_point)(model_spec, sequence_length, seed, checkpointing)
        else:
            dtype = torch.float32 if construction == "full" else training_dtype(config)
            model = build_model(model_spec, checkpointing=checkpointing, dtype=dtype)
    if entry_point:  # what trains, as a script adds it to the model it built (launchers/models/trainable.py)
        return apply_trainable(model, model_spec), batch_fn
    if four_bit:  # as from_pretrained(quantization_config=...) hands the base to the script:
        from launchers.models.four_bit import quantize_  # the seeded weights quantized, then the adapters

        seeded_init_(model, seed=seed, std=init_std(model_spec))
        quantize_(model, model_spec["quantization"], device=device)
        model = apply_trainable(model, model_spec)
    else:
        model = apply_trainable(model, model_spec)
        seeded_init_(model, seed=seed, std=init_std(model_spec))
    zero_lora_b_(model, model_spec)
    data = SyntheticTokens(vocab_size=model_spec["vocab_size"], sequence_length=sequence_length, seed=seed)
    return model, data
