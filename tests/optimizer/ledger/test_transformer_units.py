"""The itemised rows of optimizer/ledger/transformer.py on tiny shapes: every parameter tensor of the hand layout
with its module, and every activation term with its label, formula and bytes.

Where the figures come from:
- module names are the attribute paths of dsopt's own GPT (launchers/models/builtin.py: ``embed_tokens``,
  ``embed_positions``, ``layers.N.norm1``, ``.attn.q/k/v/o``, ``.norm2``, ``.mlp.fc/proj`` or ``gate/up/down``,
  ``final_norm``, ``lm_head``), which ZeRO-3 gathers module by module;
- activation labels and formulas are the rows the ledger table prints (optimizer/results/report.py renders
  ``(name, formula, bytes)``), in Korthikanti et al. 2022 §4.1 notation as the module docstring states them;
- every byte and element count is worked by hand in the comments; the GPT-2 block's sum is checked against the
  paper's s·b·h·(34 + 5·a·s/h).
``layout_tensors`` is called directly (it is not cached, unlike ``parameter_tensors``).
"""

from __future__ import annotations

from optimizer.ledger.transformer import head_terms, layer_terms, layout_tensors
from optimizer.study.specs import AttentionKind, MlpKind, NormKind, PositionKind, TransformerModel

# A GPT-2 block: h = 8, a = 2 (d = 4), one KV head (kv·d = 4 columns), f = 32, V = 16, 4 learned positions.
GPT2_GQA = TransformerModel(layers=1, hidden_size=8, heads=2, kv_heads=1, ffn_size=32, vocab_size=16,
                            max_positions=4, tied_embeddings=False)
# A Llama block: SwiGLU, RMSNorm, no biases, rotary positions, fused attention, no dropout; f = 12.
LLAMA_GQA = TransformerModel(layers=1, hidden_size=8, heads=2, kv_heads=1, ffn_size=12, vocab_size=16,
                             max_positions=4, tied_embeddings=False, attention=AttentionKind.FUSED,
                             mlp=MlpKind.SWIGLU, norm=NormKind.RMSNORM, bias=False,
                             position_embedding=PositionKind.ROPE, dropout=False)


def _rows(tensors):
    return [(t.module, t.numel) for t in tensors]


def test_gpt2_layout_lists_each_tensor_under_its_module():
    assert _rows(layout_tensors(GPT2_GQA)) == [
        ("embed_tokens", 128),  # V·h = 16·8
        ("embed_positions", 32),  # max_positions·h = 4·8
        ("layers.0.norm1", 8), ("layers.0.norm1", 8),  # LayerNorm weight and bias, h each
        ("layers.0.attn.q", 64), ("layers.0.attn.q", 8),  # h·h = 64, bias h
        ("layers.0.attn.k", 32), ("layers.0.attn.k", 4),  # h·kv·d = 8·4, bias kv·d
        ("layers.0.attn.v", 32), ("layers.0.attn.v", 4),
        ("layers.0.attn.o", 64), ("layers.0.attn.o", 8),
        ("layers.0.norm2", 8), ("layers.0.norm2", 8),
        ("layers.0.mlp.fc", 256), ("layers.0.mlp.fc", 32),  # h·f = 8·32, bias f
        ("layers.0.mlp.proj", 256), ("layers.0.mlp.proj", 8),  # f·h, bias h
        ("final_norm", 8), ("final_norm", 8),
        ("lm_head", 128),  # untied: V·h, no bias
    ]


def test_gpt2_layout_with_tied_embeddings_has_no_lm_head():
    tied = TransformerModel(layers=1, hidden_size=8, heads=2, kv_heads=1, ffn_size=32, vocab_size=16,
                            max_positions=4)
    rows = _rows(layout_tensors(tied))
    assert rows[-2:] == [("final_norm", 8), ("final_norm", 8)]
    assert len(rows) == 20  # the 21 rows above less lm_head


def test_llama_layout_has_no_positions_biases_or_norm_biases():
    assert _rows(layout_tensors(LLAMA_GQA)) == [
        ("embed_tokens", 128),  # 16·8
        ("layers.0.norm1", 8),  # RMSNorm: weight only
        ("layers.0.attn.q", 64),  # 8·8
        ("layers.0.attn.k", 32),  # 8·4
        ("layers.0.attn.v", 32),
        ("layers.0.attn.o", 64),
        ("layers.0.norm2", 8),
        ("layers.0.mlp.gate", 96),  # h·f = 8·12
        ("layers.0.mlp.up", 96),
        ("layers.0.mlp.down", 96),  # f·h
        ("final_norm", 8),
        ("lm_head", 128),
    ]


def test_gpt2_block_terms_itemised_and_summing_to_korthikanti():
    # s = 4, b = 2, h = 8 → sbh = 64; a = 2; kv·d = 4; f = 32; p = 2.
    terms = [(t.name, t.formula, t.bytes) for t in layer_terms(GPT2_GQA, seq=4, micro_batch=2, element_bytes=2)]
    assert terms == [
        ("norm inputs (2 per block)", "2·p·sbh", 256),  # 2·2·64
        ("QKV projection input", "p·sbh", 128),  # 2·64
        ("Q and K for QK^T", "p·sbh + p·sb·kv·d", 192),  # 128 + 2·4·2·4 = 128 + 64
        ("V", "p·sb·kv·d", 64),  # 2·4·2·4
        ("attention output-projection input", "p·sbh", 128),
        ("softmax output", "p·as²b", 128),  # 2·2·4²·2
        ("softmax dropout mask", "as²b", 64),  # 2·16·2
        ("softmax dropout output", "p·as²b", 128),
        ("attention dropout mask", "sbh", 64),
        ("MLP input", "p·sbh", 128),
        ("GELU input and output", "2·p·sbf", 1024),  # 2·2·4·2·32
        ("MLP dropout mask", "sbh", 64),
    ]
    # Korthikanti §4.1 with a KV head per query head: sbh(34 + 5as/h) = 64·(34 + 5·2·4/8) = 64·39 = 2496.
    # One KV head of two removes half of K and of V: 2·(p·sb·h/2) = 2·64 = 128 bytes → 2368.
    assert sum(b for _, _, b in terms) == 2496 - 128


def test_swiglu_fused_block_terms_itemised():
    # s = 4, b = 2, h = 8 → sbh = 64; a = 2; kv·d = 4; f = 12; p = 2; no dropout.
    terms = [(t.name, t.formula, t.bytes) for t in layer_terms(LLAMA_GQA, seq=4, micro_batch=2, element_bytes=2)]
    assert terms == [
        ("norm inputs (2 per block)", "2·p·sbh", 256),
        ("QKV projection input", "p·sbh", 128),
        ("Q and K for QK^T", "p·sbh + p·sb·kv·d", 192),
        ("V", "p·sb·kv·d", 64),
        ("attention output-projection input", "p·sbh", 128),
        ("flash-attention log-sum-exp (fp32)", "4·asb", 64),  # 4·2·4·2
        ("MLP input", "p·sbh", 128),
        ("SwiGLU gate, up, SiLU, product", "4·p·sbf", 768),  # 4·2·4·2·12
    ]


def test_head_terms_itemised_with_and_without_dropout():
    # s = 4, b = 2, h = 8 → sbh = 64; V = 16; p = 2.
    with_dropout = [(t.name, t.formula, t.bytes) for t in head_terms(GPT2_GQA, seq=4, micro_batch=2, element_bytes=2)]
    assert with_dropout == [
        ("embedding dropout mask", "sbh", 64),
        ("final norm input", "p·sbh", 128),
        ("LM-head input", "p·sbh", 128),
        ("logits for cross-entropy (fp32)", "4·sbV", 512),  # 4·4·2·16
    ]
    without = [(t.name, t.formula, t.bytes) for t in head_terms(LLAMA_GQA, seq=4, micro_batch=2, element_bytes=2)]
    assert without == with_dropout[1:]
