"""The study's model at a tiny width: what the probe runs DeepSpeed's engine on to time its cost per micro-step (pure).

A step of a small model on CPU ranks — and of any model's many small calls on GPUs — is mostly not FLOPs or bytes
but DeepSpeed's own work per micro-step: its hooks on every module and parameter, the gradient buckets it fills and
reduces one collective call at a time (ZeRO-1/2: one per ``reduce_bucket_size``; ZeRO-3: a gather per module and
prefetch bucket), each call's latency, and its work per optimizer step (ZeRO-1 reduces and gathers then; ZeRO-2
reduces every micro-step). The time model's ``micro_steps_z*`` rates (:mod:`optimizer.perf.throughput`) are that
cost. Measured on the grid of ``studies/grid-cpu.yaml``, a ZeRO-2 micro-step costs ~50 ms of which the model's
FLOPs take ~1 ms.

That cost follows the model's *structure* — its layers, the modules and tensors in each, what trains, the number
of buckets — not its width. :func:`skeleton_model` keeps the structure and shrinks the width to
``heads × SKELETON_HEAD_DIM`` (at least :data:`SKELETON_MIN_HIDDEN`); the MLP, the vocabulary and a learned
position table shrink by the same ratio. The probe builds its DeepSpeed config with the study's own rule
(:mod:`optimizer.deepspeed.zero_settings`: buckets h², persistence 10·h), so each bucket holds as many of the
skeleton's tensors as the study's holds of its own — the same number of collective calls — while FLOPs and bytes,
which the probe times apart, all but vanish.
What the skeleton does not keep: a call's bandwidth part (the probe's collectives time it), and element-wise
work proportional to the width (norms, activations: not in the FLOP count either).

Where only part of the model trains the h² rule does not keep the count: PEFT's adapters keep their rank r, so
they shrink by the width ratio alone (r·(fan_in + fan_out)) while the h² bucket shrinks by its square. On
grid-lora-gpt2-cpu (ratio 1/3: 36,864 trainable elements in buckets of 9,216, the skeleton's 12,288 in buckets
of 1,024) the skeleton reduced ~15 buckets per micro-step against the study's ~5, and its probed ZeRO-2
micro-step read 24 ms against ZeRO-1's 6 ms, where the grid's ZeRO-2 rows at 1 and 2 micro-steps per step ran at
the same speed. There the skeleton's buckets are sized by what trains (:func:`skeleton_bucket_elements`).
"""

from __future__ import annotations

import json
from dataclasses import replace

from optimizer.deepspeed.zero_settings import BUCKET_ALIGNMENT, zero_settings
from optimizer.ledger.transformer import trainable_count
from optimizer.study.knobs import ZeroStage
from optimizer.study.specs import PositionKind, TransformerModel

SKELETON_HEAD_DIM = 2
"""Width per attention head of the skeleton (even, for rotary embeddings)."""
SKELETON_MIN_HIDDEN = 32
"""Narrowest skeleton: ``stage3_param_persistence_threshold`` is 10·h, so at h ≥ 32 a skeleton's weight matrices
(h² ≥ 32·h) are partitioned like the study's and its norms and biases (h) persist like the study's."""
SKELETON_TOKENS = 16
"""Sequence length of the skeleton's micro-batch (one sample): its compute is noise beside the engine's."""
SKELETON_MICRO_STEPS = 2
"""Gradient accumulation of the skeleton's engine: one micro-step that only accumulates, one that steps."""

HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
"""Where transformers configs keep the width (GPT-2: ``n_embd``)."""
FFN_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff")
"""Where they keep the MLP width (:data:`optimizer.study.hf_config.FFN_KEYS`)."""
POSITION_KEYS = ("max_position_embeddings", "n_positions")
"""Where they keep a learned position table's length."""


def skeleton_model(model: TransformerModel) -> TransformerModel | str:
    """``model`` at the skeleton's width (module doc), or why it cannot be shrunk: a model the study builds with its
    own code (``model.entry_point``) has the width its code gives it."""
    if model.entry_point is not None:
        return (f"the study's model is built by its own code ({model.entry_point}): its width is not dsopt's to "
                "shrink")
    head_dim = max(SKELETON_HEAD_DIM, -(-SKELETON_MIN_HIDDEN // model.heads))
    head_dim += head_dim % 2
    hidden = model.heads * head_dim
    ratio = hidden / model.hidden_size
    ffn = max(2, round(model.ffn_size * ratio))
    vocab = max(SKELETON_TOKENS, round(model.vocab_size * ratio))
    positions = max(SKELETON_TOKENS, round(model.max_positions * ratio)) \
        if model.position_embedding is PositionKind.LEARNED else model.max_positions  # a table of positions × h
    config = None
    if model.hf_config is not None:
        settings = json.loads(model.hf_config)
        for key in HIDDEN_KEYS:
            if settings.get(key) is not None:
                settings[key] = hidden
        for key in FFN_KEYS:
            if settings.get(key) is not None:
                settings[key] = ffn
        if settings.get("head_dim") is not None:
            settings["head_dim"] = head_dim
        settings["vocab_size"] = vocab
        for key in POSITION_KEYS:
            if settings.get(key) is not None and model.position_embedding is PositionKind.LEARNED:
                settings[key] = positions
        config = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return replace(model, hidden_size=hidden, ffn_size=ffn, vocab_size=vocab, hf_config=config,
                   max_positions=positions, inventory=None, traced_activations=())


def skeleton_bucket_elements(*, model: TransformerModel, skeleton: TransformerModel) -> int | None:
    """The ZeRO reduce (and all-gather) bucket of ``skeleton`` — ``model``'s, with what trains in it taken as its
    inventory says (:func:`optimizer.ledger.transformer.trainable_count`) — that splits one gradient pass into as
    many buckets as ``model``'s bucket splits ``model``'s: the study's bucket scaled by the two trainable counts,
    aligned. None where everything trains — dsopt's own rule (h²) keeps the count there (module doc) — or where
    either model has no inventory to say what trains. DeepSpeed fills a bucket with the gradients in backward
    order and reduces it when the next would overflow it (``stage_1_and_2.py``
    ``reduce_independent_p_g_buckets_and_remove_grads``): ZeRO-1 once per step, ZeRO-2 every micro-step."""
    if not model.adapted or model.inventory is None or skeleton.inventory is None:
        return None
    if not trainable_count(model) or not trainable_count(skeleton):
        return None
    bucket = zero_settings(model=model, stage=ZeroStage.GRADIENTS).reduce_bucket_elements
    scaled = -(-bucket * trainable_count(skeleton) // trainable_count(model))
    return max(BUCKET_ALIGNMENT, -(-scaled // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT)
