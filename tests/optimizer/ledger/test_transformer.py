"""Parameter counts and Korthikanti et al. 2022's activation formula, checked on known models."""

from __future__ import annotations

import pytest

from optimizer.ledger.transformer import (
    activation_estimate,
    attention_core_terms,
    head_terms,
    largest_layer_parameters,
    layer_terms,
    parameter_count,
)
from optimizer.study.knobs import EveryKCheckpointing, FullCheckpointing, NoCheckpointing, SelectiveCheckpointing
from optimizer.study.specs import AttentionKind, MlpKind, NormKind, PositionKind, TransformerModel


def gpt(layers, hidden, heads, vocab=50257, positions=1024, **kw) -> TransformerModel:
    return TransformerModel(layers=layers, hidden_size=hidden, heads=heads, kv_heads=heads, ffn_size=4 * hidden,
                            vocab_size=vocab, max_positions=positions, **kw)


def llama(layers, hidden, heads, kv_heads, ffn, vocab) -> TransformerModel:
    return TransformerModel(layers=layers, hidden_size=hidden, heads=heads, kv_heads=kv_heads, ffn_size=ffn,
                            vocab_size=vocab, tied_embeddings=False, attention=AttentionKind.FUSED,
                            mlp=MlpKind.SWIGLU, norm=NormKind.RMSNORM, bias=False,
                            position_embedding=PositionKind.ROPE, dropout=False, max_positions=4096)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        # Published parameter counts (Hugging Face model cards / `model.num_parameters()`).
        (gpt(12, 768, 12), 124_439_808),  # gpt2
        (gpt(24, 1024, 16), 354_823_168),  # gpt2-medium
        (llama(32, 4096, 32, 32, 11008, 32000), 6_738_415_616),  # Llama-2-7b
        (llama(32, 4096, 32, 8, 14336, 128256), 8_030_261_248),  # Llama-3-8B (grouped-query attention)
    ],
)
def test_parameter_count_matches_published_models(model, expected):
    assert parameter_count(model) == expected


def test_largest_layer_is_the_embedding_for_gpt2():
    assert largest_layer_parameters(gpt(12, 768, 12)) == 50257 * 768


def test_korthikanti_per_layer_formula_on_a_gpt3_layer():
    # GPT-3 175B: h = 12288, a = 96, s = 2048; Korthikanti §4.1: sbh(34 + 5as/h), 16-bit activations.
    model = gpt(96, 12288, 96, positions=2048)
    s, b, h, a = 2048, 1, 12288, 96
    per_layer = sum(t.bytes for t in layer_terms(model, seq=s, micro_batch=b, element_bytes=2))
    assert per_layer == s * b * h * 34 + 5 * a * s * s * b
    assert per_layer == round(s * b * h * (34 + 5 * a * s / h))


def test_fused_attention_drops_the_s_squared_term():
    eager = gpt(2, 256, 8)
    fused = gpt(2, 256, 8, attention=AttentionKind.FUSED)
    s, b, a = 512, 2, 8
    eager_bytes = sum(t.bytes for t in layer_terms(eager, seq=s, micro_batch=b, element_bytes=2))
    fused_bytes = sum(t.bytes for t in layer_terms(fused, seq=s, micro_batch=b, element_bytes=2))
    # 5as²b is gone; flash attention keeps an fp32 log-sum-exp per row and head (4asb).
    assert eager_bytes - fused_bytes == 5 * a * s * s * b - 4 * a * s * b


def test_fp32_doubles_every_term_but_the_one_byte_masks():
    model = gpt(2, 256, 8)
    s, b, h, a = 128, 2, 256, 8
    half = sum(t.bytes for t in layer_terms(model, seq=s, micro_batch=b, element_bytes=2))
    full = sum(t.bytes for t in layer_terms(model, seq=s, micro_batch=b, element_bytes=4))
    masks = 2 * s * b * h + a * s * s * b  # attention + MLP dropout masks, softmax dropout mask
    assert full == 2 * half - masks


def test_checkpointing_granularities():
    model = gpt(4, 256, 8, vocab=1000, positions=128)
    s, b, p, h = 128, 2, 2, 256
    layer = sum(t.bytes for t in layer_terms(model, seq=s, micro_batch=b, element_bytes=p))
    core = sum(t.bytes for t in attention_core_terms(model, seq=s, micro_batch=b, element_bytes=p))
    head = sum(t.bytes for t in head_terms(model, seq=s, micro_batch=b, element_bytes=p))
    boundary = p * s * b * h  # Korthikanti's 2sbh per checkpointed layer

    def est(ckpt):
        return activation_estimate(model, checkpointing=ckpt, seq=s, micro_batch=b, element_bytes=p)

    assert est(NoCheckpointing()).total_bytes == 4 * layer + head
    assert est(FullCheckpointing()).stored_bytes == 4 * boundary + head
    assert est(FullCheckpointing()).recompute_bytes == layer
    every2 = est(EveryKCheckpointing(k=2))
    assert every2.stored_bytes == 2 * boundary + 2 * layer + head
    assert every2.recompute_bytes == layer
    selective = est(SelectiveCheckpointing())
    assert selective.stored_bytes == 4 * (layer - core) + head
    assert selective.recompute_bytes == core
    # Korthikanti §4.2: selective recompute keeps 34sbh per layer (16-bit, GPT-2 block).
    assert layer - core == 34 * s * b * h
    totals = [est(c).total_bytes for c in (FullCheckpointing(), EveryKCheckpointing(k=2), NoCheckpointing())]
    assert totals == sorted(totals)


def test_logits_are_counted_in_fp32():
    model = gpt(1, 64, 4, vocab=50000, positions=16)
    terms = {t.name: t.bytes for t in head_terms(model, seq=16, micro_batch=3, element_bytes=2)}
    assert terms["logits for cross-entropy (fp32)"] == 4 * 16 * 3 * 50000
