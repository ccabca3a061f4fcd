"""Bounds beyond which no real model, batch or device exists (pure).

A study value past these is a typo (``layers: 80000`` for 80, ``sequence_length: 1e26``) or a unit slip
(``gpu_memory: 80 TB`` for 80 GB). Refusing it at once, naming the key, beats building per-layer lists for
minutes or pruning every candidate with a figure no one can read. Each bound sits orders of magnitude above
the largest real value, cited beside it, so that no real configuration of today or the next years meets it.
"""

from __future__ import annotations

MAX_PARAMETERS = 10**15
"""Parameters of a seed-mode model (a quadrillion). Largest published dense/MoE models: ~1.6–2 T."""
MAX_LAYERS = 10_000
"""Transformer blocks. Largest trained: 1,000 (DeepNet, Wang et al. 2022, arXiv:2203.00555); LLMs: 126
(Llama-3.1-405B), 118 (PaLM-540B)."""
MAX_WIDTH = 1 << 20
"""Hidden size, heads, key/value heads (1,048,576). Largest hidden size: 20,480 (Megatron-Turing NLG 530B),
18,432 (PaLM), 16,384 (Llama-3.1-405B)."""
MAX_FFN = 1 << 22
"""MLP width (4,194,304). Largest: 73,728 (PaLM 540B), 53,248 (Llama-3.1-405B)."""
MAX_VOCAB = 1 << 24
"""Vocabulary (16,777,216). Largest: 262,144 (Gemma 3), 256,000 (PaLM, Gemma)."""
MAX_TOKENS = 1 << 28
"""Sequence length / positions (268,435,456). Longest context of a released model: 10 M tokens (Llama 4
Scout, 2025)."""
MAX_BATCH = 1 << 24
"""Sequences per global or micro-batch (16,777,216). GPT-3's batch was 3.2 M tokens = 1,563 sequences of 2,048."""
MAX_SEQUENCES_PER_SAMPLE = 1 << 10
"""Sequences the model runs per sample (1,024): 2 for a DPO pair; a best-of-n or group method (GRPO's group of
completions per prompt, typically 4-64) runs more."""
MAX_DEVICES = 1 << 20
"""Nodes, devices per node, devices in all (1,048,576). Largest training jobs: ~100,000 GPUs (2024–2025)."""
MAX_DEVICE_BYTES = 1 << 44
"""Memory of one device (16 TiB). Largest GPU memory: 288 GB HBM3e (B300); an accelerator past 16 TiB
does not exist."""
MAX_HOST_BYTES = 1 << 50
"""Host RAM of one node (1 PiB). Largest single-system memory: tens of TB (32-socket servers)."""
MAX_NVME_BYTES = 1 << 56
"""NVMe capacity of one node (64 PiB); a node's local flash is ~100s of TB at most."""

MODEL_LIMITS = {"layers": (MAX_LAYERS, "layer count"), "hidden_size": (MAX_WIDTH, "hidden size"),
                "heads": (MAX_WIDTH, "attention head count"), "kv_heads": (MAX_WIDTH, "key/value head count"),
                "ffn_size": (MAX_FFN, "MLP width"), "vocab_size": (MAX_VOCAB, "vocabulary"),
                "max_positions": (MAX_TOKENS, "context length")}
"""A transformer's counts (the model spec's field names) and the bound past which no real model has them."""


def beyond(value: int, limit: int, what: str, *, unit: str = "") -> str:
    """Why ``value`` is refused (``''`` when it is within ``limit``): one phrase, the bound and where it comes from."""
    if value <= limit:
        return ""
    shown = f"{limit:,} bytes = {limit / 2**40:,.0f} TiB" if unit == "bytes" else f"{limit:,}"
    return (f"{value:,}{' bytes' if unit == 'bytes' else ''} is beyond any real {what} (dsopt accepts at most "
            f"{shown}; optimizer/study/limits.py cites the largest real ones)")


def check_count(name: str, value: int, limit: int, what: str) -> None:
    """ValueError starting with ``name`` (the spec field) when ``value`` exceeds ``limit``."""
    why = beyond(value, limit, what)
    if why:
        raise ValueError(f"{name} {why}")
