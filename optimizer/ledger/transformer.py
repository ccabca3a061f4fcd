"""Parameter count and per-layer activation bytes of a decoder-only transformer (pure).

The activation terms are Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv 2205.05198), §4.1, written out tensor by tensor so that each term can
be generalised and checked. For a GPT-2 block (4h GELU MLP, LayerNorm, dropout, a KV head per
query head) with 16-bit activations and 1-byte dropout masks they sum to the paper's

    per layer: s·b·h·(34 + 5·a·s/h) bytes
      attention 11·sbh + 5·a·s²·b, MLP 19·sbh, two LayerNorms 4·sbh.

Symbols: s sequence length, b micro-batch, h hidden size, a heads, f FFN size, V vocabulary,
p bytes per activation element (2 for bf16/fp16, 4 for fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from optimizer.ledger.quantized import four_bit_bytes, packed_elements
from optimizer.study.knobs import (
    Checkpointing,
    EveryKCheckpointing,
    FullCheckpointing,
    NoCheckpointing,
    SelectiveCheckpointing,
)
from optimizer.study.quantization_section import FourBitBase
from optimizer.study.specs import AttentionKind, MlpKind, NormKind, PositionKind, TransformerModel

MASK_BYTES = 1
"""A dropout mask element (``torch.bool``), Korthikanti §4.1."""

LOGIT_BYTES = 4
"""Cross-entropy runs on FP32 logits: Korthikanti §4.1 counts 4·s·b·V for them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParameterTensor:
    """One parameter tensor of the model."""

    module: str
    """The module that owns it (ZeRO-3 gathers a module's own parameters together)."""
    numel: int
    """Elements."""
    trainable: bool = True
    """It trains: DeepSpeed makes its gradient, master copy and optimizer states (the inventory's flag)."""
    four_bit: bool = False
    """A 4-bit weight of a QLoRA base (the inventory's flag; never trainable)."""
    adapter: bool = False
    """A PEFT adapter's own tensor, fp32 in a bf16/fp16 model (the inventory's flag)."""


@lru_cache(maxsize=64)
def parameter_tensors(model: TransformerModel) -> tuple[ParameterTensor, ...]:
    """Every trainable tensor: the model's parameter inventory when it has one (a ``transformers`` config or an
    entry point, built on the meta device), else laid out as GPT-2 (Radford et al. 2019) and Llama (Touvron et
    al. 2023) are in Hugging Face ``transformers``. Cached: specs are frozen.

    Per block: attention Q and O (h·h each) and K, V (h·kv·d each, d = h/a) with optional biases;
    MLP 2·h·f (GELU: fc, proj) or 3·h·f (SwiGLU: gate, up, down) with optional biases; two norms
    (LayerNorm: weight and bias of h; RMSNorm: weight). Learned positions add ``max_positions``·h;
    an untied LM head adds V·h.
    """
    if model.inventory is not None:  # the model as its code builds it (optimizer/study/inventory.py)
        return tuple(ParameterTensor(module=t.module, numel=t.numel, trainable=t.trainable, four_bit=t.four_bit,
                                     adapter=t.adapter)
                     for t in model.inventory.tensors)
    return layout_tensors(model)


@lru_cache(maxsize=64)
def trainable_tensors(model: TransformerModel) -> tuple[ParameterTensor, ...]:
    """The tensors that train, in the model's order: what DeepSpeed's optimizer sees. ZeRO-1/2 flattens only
    these (``stage_1_and_2.py:428-434``, ``runtime/utils.py:815-825`` ``is_optimized_parameter``), ZeRO-3 keeps
    master weights, gradients and states for these alone (``stage3.py:726-745``)."""
    return tuple(t for t in parameter_tensors(model) if t.trainable)


@lru_cache(maxsize=64)
def trainable_count(model: TransformerModel) -> int:
    """Ψₜ: elements of the tensors that train (Ψ for a full fine-tune)."""
    return sum(t.numel for t in trainable_tensors(model))


def layout_tensors(model: TransformerModel) -> tuple[ParameterTensor, ...]:
    """The hand layout of :func:`parameter_tensors` from the shape alone (GPT-2/Llama blocks)."""
    h, f, V = model.hidden_size, model.ffn_size, model.vocab_size
    kv = model.kv_heads * model.head_dim
    out = [ParameterTensor(module="embed_tokens", numel=V * h)]
    if model.position_embedding is PositionKind.LEARNED:
        out.append(ParameterTensor(module="embed_positions", numel=model.max_positions * h))

    def linear(name: str, fan_in: int, fan_out: int) -> list[ParameterTensor]:
        weight = [ParameterTensor(module=name, numel=fan_in * fan_out)]
        return weight + ([ParameterTensor(module=name, numel=fan_out)] if model.bias else [])

    def norm(name: str) -> list[ParameterTensor]:
        tensors = [ParameterTensor(module=name, numel=h)]
        return tensors + ([ParameterTensor(module=name, numel=h)] if model.norm is NormKind.LAYERNORM else [])

    mlp = (("fc", h, f), ("proj", f, h)) if model.mlp is MlpKind.GELU else (("gate", h, f), ("up", h, f),
                                                                            ("down", f, h))
    for layer in range(model.layers):
        prefix = f"layers.{layer}"
        out += norm(f"{prefix}.norm1")
        for name, fan_out in (("q", h), ("k", kv), ("v", kv), ("o", h)):
            out += linear(f"{prefix}.attn.{name}", h, fan_out)
        out += norm(f"{prefix}.norm2")
        for name, fan_in, fan_out in mlp:
            out += linear(f"{prefix}.mlp.{name}", fan_in, fan_out)
    out += norm("final_norm")
    if not model.tied_embeddings:
        out.append(ParameterTensor(module="lm_head", numel=V * h))
    return tuple(out)


@lru_cache(maxsize=64)
def held_tensors(model: TransformerModel) -> tuple[ParameterTensor, ...]:
    """:func:`parameter_tensors` as DeepSpeed's ZeRO-3 sees them: a 4-bit weight is a ``Params4bit`` of ⌈n/2⌉
    packed bytes viewed as ``bnb_4bit_quant_storage`` elements (``bitsandbytes/backends/default/ops.py``
    ``quantize_4bit``), which ZeRO-3 partitions, gathers and keeps persistent like any parameter — of the training
    dtype, as a ZeRO-3 candidate of a QLoRA study must store them (:mod:`optimizer.study.quantization_section`).
    The same tensors as :func:`parameter_tensors` without ``model.quantization``."""
    tensors = parameter_tensors(model)
    if model.quantization is None:
        return tensors
    storage = FourBitBase.from_json(model.quantization).storage_bytes
    return tuple(ParameterTensor(module=t.module, numel=packed_elements(t.numel, storage_bytes=storage),
                                 trainable=False) if t.four_bit else t for t in tensors)


@dataclass(frozen=True, kw_only=True, slots=True)
class FourBitWeights:
    """The 4-bit weights of a QLoRA base (all zero without ``model.quantization``)."""

    elements: int
    """Ψ₄: their elements (the weights' own count, two per packed byte)."""
    held_bytes: int
    """Their bytes whole: packed weights + quantization statistics (:func:`optimizer.ledger.quantized.four_bit_bytes`
    per tensor)."""
    statistics_bytes: int
    """The statistics alone (absmax, codebooks): not parameters, so never partitioned by ZeRO-3."""
    packed_bytes: int
    """The packed weights alone (⌈n/2⌉ each): what ZeRO-3 gathers and parameter offload moves for them."""
    largest: int
    """Elements of the largest 4-bit weight (the one dequantized for its matmul at the peak)."""
    largest_blocks: int
    """Its absmax blocks (nested quantization dequantizes them to fp32 for the matmul)."""


@lru_cache(maxsize=64)
def four_bit_weights(model: TransformerModel) -> FourBitWeights:
    """:class:`FourBitWeights` of ``model``'s inventory under its ``model.quantization``."""
    if model.quantization is None:
        return FourBitWeights(elements=0, held_bytes=0, statistics_bytes=0, packed_bytes=0, largest=0,
                              largest_blocks=0)
    base = FourBitBase.from_json(model.quantization)
    sizes = [t.numel for t in parameter_tensors(model) if t.four_bit]
    parts = [four_bit_bytes(n, blocksize=base.blocksize, double_quant=base.double_quant, storage_bytes=1)
             for n in sizes]
    largest = max(sizes, default=0)
    return FourBitWeights(elements=sum(sizes), held_bytes=sum(p.total for p in parts),
                          statistics_bytes=sum(p.statistics for p in parts),
                          packed_bytes=sum(p.packed for p in parts), largest=largest,
                          largest_blocks=-(-largest // base.blocksize))


@lru_cache(maxsize=64)
def zero3_partition_elements(model: TransformerModel, *, ranks: int, trainable_only: bool = False) -> int:
    """Q = Σₚ ⌈nₚ/N⌉: ZeRO-3 pads every tensor to a multiple of N (``partition_parameters.py:1690-1696``) and
    partitions frozen ones too (4-bit weights as their packed storage elements, :func:`held_tensors`);
    ``trainable_only``: Qₜ, over the tensors that train (the gradient, master and optimizer partitions)."""
    tensors = trainable_tensors(model) if trainable_only else held_tensors(model)
    return sum(-(-t.numel // ranks) for t in tensors)


@lru_cache(maxsize=64)
def parameter_count(model: TransformerModel) -> int:
    """Trainable parameters Ψ: the sum over :func:`parameter_tensors`."""
    return sum(t.numel for t in parameter_tensors(model))


@lru_cache(maxsize=64)
def largest_layer_parameters(model: TransformerModel, *, trainable_only: bool = False) -> int:
    """Parameters of the largest single module — what ZeRO-3 gathers at once (frozen ones too: a frozen
    Linear's weight is needed for its input's gradient).

    DeepSpeed's estimator takes the max over modules of their own (non-recursive) parameters
    (``stage3.py: estimate_zero3_model_states_mem_needs_all_live``); so does this. ``trainable_only``: the most
    trainable elements one module owns — the full gradient of the module at hand before its reduce-scatter.
    """
    per_module: dict[str, int] = {}
    for tensor in trainable_tensors(model) if trainable_only else held_tensors(model):
        per_module[tensor.module] = per_module.get(tensor.module, 0) + tensor.numel
    return max(per_module.values(), default=0)


@lru_cache(maxsize=64)
def tied_copy_elements(model: TransformerModel) -> int:
    """Elements of the tensors a tied weight's other modules are built with before the tie replaces them
    (transformers builds ``lm_head`` with its own weight and ``tie_weights`` then points it at the embedding,
    ``modeling_utils.py:2624`` in 5.24, ``setattr(parent, name, source_param)``; a script's
    ``head.weight = embed.weight`` does the same).
    From the parameter inventory's tied groups; 0 without one (dsopt's GPT reuses the embedding in its head)."""
    inventory = model.inventory
    if inventory is None or not inventory.tied:
        return 0
    numel = {t.name: t.numel for t in inventory.tensors}
    return sum(numel.get(group[0], 0) * (len(group) - 1) for group in inventory.tied)


@lru_cache(maxsize=64)
def largest_tensor_parameters(model: TransformerModel, *, trainable_only: bool = False) -> int:
    """Elements of the largest single parameter tensor; ``trainable_only``: of the largest that trains (the
    gradient buffers ZeRO-1/2 and the offload boundary size by it)."""
    return max((t.numel for t in (trainable_tensors(model) if trainable_only else parameter_tensors(model))),
               default=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatPartition:
    """How ZeRO-1/2's flat parameter buffer splits over the ranks, from the model's parameter order."""

    padded: int
    """Ψ₁₂: the trainable elements padded to a multiple of 2N (the flat buffer's length)."""
    held: int
    """Σ: elements of the tensors the worst rank counts as its own (``params_in_partition``), in full."""
    largest_piece: int
    """Elements of the largest part of one tensor inside one rank's range (DeepSpeed's ``num_elements``)."""
    ranks: int
    """N."""

    @property
    def per_rank(self) -> int:
        """P = Ψ₁₂/N: each rank's range of the flat buffer."""
        return self.padded // self.ranks


@lru_cache(maxsize=64)
def zero12_partition(model: TransformerModel, *, ranks: int) -> FlatPartition:
    """Σ and the largest piece of ZeRO-1/2's partition, over the tensors of :func:`trainable_tensors` in order.

    DeepSpeed 0.19.8 flattens the group's tensors in ``model.parameters()`` order (``stage_1_and_2.py:429-433``;
    ``round_robin_gradients`` and ``parameter_alignment`` are off by default, ``config.py:309, 317``, and dsopt
    sets neither: no reordering at ``:469-474``, no padding between tensors at ``:444, 496``), pads the whole to
    a multiple of 2N (``:441, 505``) and gives each rank P = padded/N elements (``:586``). Rank r owns the tensors
    that start in [rP, (r+1)P) or start before rP and cross it (``get_partition_info``, ``:2596-2600``);
    ``grads_in_partition`` and offload's accumulation buffers hold those tensors in full (``:2184-2194``,
    ``:1824``), offload's gradient norm works on each one's part in range (``get_grad_position``, ``:1740-1762``).
    The ledger is per rank: the worst rank's Σ.
    """
    sizes = [t.numel for t in trainable_tensors(model)]  # the flat group holds the trainable tensors only
    padded = -(-sum(sizes) // (2 * ranks)) * (2 * ranks)
    p = padded // ranks
    held = [0] * (ranks + 1)  # a difference array over the ranks
    largest_piece = 0
    start = 0
    for numel in sizes:
        end = start + numel
        if numel:
            first, last = start // p, (end - 1) // p  # it starts in `first`'s range and crosses every later start
            held[first] += numel
            held[last + 1] -= numel
            pieces = (numel,) if first == last else ((first + 1) * p - start, end - last * p,
                                                      p if last - first > 1 else 0)
            largest_piece = max(largest_piece, *pieces)
        start = end
    worst = running = 0
    for delta in held[:ranks]:
        running += delta
        worst = max(worst, running)
    return FlatPartition(padded=padded, held=worst, largest_piece=largest_piece, ranks=ranks)


@lru_cache(maxsize=64)
def persistent_parameters(model: TransformerModel, *, threshold: int) -> int:
    """Elements ZeRO-3 never partitions: tensors with numel ≤ ``stage3_param_persistence_threshold``
    (``runtime/zero/parameter_offload.py``, ``ds_persist``); 4-bit weights as their packed storage elements."""
    return sum(t.numel for t in held_tensors(model) if t.numel <= threshold)


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationTerm:
    """One stored tensor class of the activation ledger."""

    name: str
    """What is stored."""
    formula: str
    """The term in Korthikanti's notation, e.g. ``2sbh``."""
    bytes: int
    """Bytes for the given shape."""


def layer_terms(
    model: TransformerModel, *, seq: int, micro_batch: int, element_bytes: int
) -> tuple[ActivationTerm, ...]:
    """Activations one block keeps for backward, itemised (Korthikanti §4.1).

    ``element_bytes`` is p (2 for 16-bit, 4 for fp32 training); masks are 1 byte. GQA shrinks
    the stored K and V to kv·d columns; fused/flash attention stores no s×s tensor but its
    per-row log-sum-exp (FP32, a·s·b; Dao 2023, FlashAttention-2 §3.1); SwiGLU stores the gate and
    up projections, their SiLU and their product (4·sbf) where GELU stores 2·sbf.
    """
    s, b, h, a, f = seq, micro_batch, model.hidden_size, model.heads, model.ffn_size
    p = element_bytes
    sbh = s * b * h
    kv_cols = model.kv_heads * model.head_dim
    terms = [
        ActivationTerm(name="norm inputs (2 per block)", formula="2·p·sbh", bytes=2 * p * sbh),
        ActivationTerm(name="QKV projection input", formula="p·sbh", bytes=p * sbh),
        ActivationTerm(name="Q and K for QK^T", formula="p·sbh + p·sb·kv·d", bytes=p * sbh + p * s * b * kv_cols),
        ActivationTerm(name="V", formula="p·sb·kv·d", bytes=p * s * b * kv_cols),
        ActivationTerm(name="attention output-projection input", formula="p·sbh", bytes=p * sbh),
    ]
    terms.extend(attention_core_terms(model, seq=seq, micro_batch=micro_batch, element_bytes=element_bytes))
    if model.dropout:
        terms.append(ActivationTerm(name="attention dropout mask", formula="sbh", bytes=MASK_BYTES * sbh))
    terms.append(ActivationTerm(name="MLP input", formula="p·sbh", bytes=p * sbh))
    if model.mlp is MlpKind.GELU:
        terms.append(ActivationTerm(name="GELU input and output", formula="2·p·sbf", bytes=2 * p * s * b * f))
    else:
        terms.append(ActivationTerm(name="SwiGLU gate, up, SiLU, product", formula="4·p·sbf", bytes=4 * p * s * b * f))
    if model.dropout:
        terms.append(ActivationTerm(name="MLP dropout mask", formula="sbh", bytes=MASK_BYTES * sbh))
    del a
    return tuple(terms)


def attention_core_terms(
    model: TransformerModel, *, seq: int, micro_batch: int, element_bytes: int
) -> tuple[ActivationTerm, ...]:
    """What the attention core (QK^T, softmax, dropout) keeps: the part selective recompute drops.

    Eager: softmax output p·as²b, its dropout mask as²b and the dropout output p·as²b — the
    paper's 5·as²b at p = 2 (without dropout only the softmax output). Fused/flash: the FP32
    log-sum-exp, 4·asb.
    """
    s, b, a, p = seq, micro_batch, model.heads, element_bytes
    if model.attention is AttentionKind.FUSED:
        return (ActivationTerm(name="flash-attention log-sum-exp (fp32)", formula="4·asb", bytes=4 * a * s * b),)
    terms = [ActivationTerm(name="softmax output", formula="p·as²b", bytes=p * a * s * s * b)]
    if model.dropout:
        terms.append(ActivationTerm(name="softmax dropout mask", formula="as²b", bytes=MASK_BYTES * a * s * s * b))
        terms.append(ActivationTerm(name="softmax dropout output", formula="p·as²b", bytes=p * a * s * s * b))
    return tuple(terms)


def head_terms(
    model: TransformerModel, *, seq: int, micro_batch: int, element_bytes: int
) -> tuple[ActivationTerm, ...]:
    """Activations outside the blocks (Korthikanti §4.3): embedding dropout mask, final norm
    input, LM-head input, and the FP32 logits cross-entropy keeps (4·sbV)."""
    s, b, h, p = seq, micro_batch, model.hidden_size, element_bytes
    terms = []
    if model.dropout:
        terms.append(ActivationTerm(name="embedding dropout mask", formula="sbh", bytes=MASK_BYTES * s * b * h))
    terms.append(ActivationTerm(name="final norm input", formula="p·sbh", bytes=p * s * b * h))
    terms.append(ActivationTerm(name="LM-head input", formula="p·sbh", bytes=p * s * b * h))
    terms.append(ActivationTerm(name="logits for cross-entropy (fp32)", formula="4·sbV",
                                bytes=LOGIT_BYTES * s * b * model.vocab_size))
    return tuple(terms)


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationEstimate:
    """Activation bytes per GPU at the forward→backward peak, split as the ledger shows them."""

    stored_bytes: int
    """Kept across all blocks and the head until backward reaches them."""
    recompute_bytes: int
    """Working set of the one block being recomputed in backward (0 without recompute)."""
    formula: str
    """How the two figures were obtained, in the paper's notation."""

    @property
    def total_bytes(self) -> int:
        return self.stored_bytes + self.recompute_bytes


def activation_estimate(
    model: TransformerModel, *, checkpointing: Checkpointing, seq: int, micro_batch: int, element_bytes: int
) -> ActivationEstimate:
    """Peak activation bytes for a checkpointing granularity (Korthikanti §4.2, §5).

    * none: L · layer + head.
    * full: each block keeps its input p·sbh (the paper's 2sbhL at p = 2); during backward one
      block is recomputed, so its full activations are live once more: + layer.
    * every_K: blocks K, 2K, … (⌊L/K⌋ of them) keep only their input; the others keep everything;
      + one recomputed block.
    * selective: every block drops its attention core (the as² terms); backward recomputes
      one block's core.
    """
    layer = sum(t.bytes for t in layer_terms(model, seq=seq, micro_batch=micro_batch, element_bytes=element_bytes))
    core = sum(t.bytes for t in attention_core_terms(model, seq=seq, micro_batch=micro_batch,
                                                      element_bytes=element_bytes))
    head = sum(t.bytes for t in head_terms(model, seq=seq, micro_batch=micro_batch, element_bytes=element_bytes))
    boundary = element_bytes * seq * micro_batch * model.hidden_size
    L = model.layers
    if isinstance(checkpointing, NoCheckpointing):
        return ActivationEstimate(stored_bytes=L * layer + head, recompute_bytes=0, formula="L·layer + head")
    if isinstance(checkpointing, FullCheckpointing):
        return ActivationEstimate(stored_bytes=L * boundary + head, recompute_bytes=layer,
                                  formula="L·p·sbh + head, + 1 recomputed layer")
    if isinstance(checkpointing, EveryKCheckpointing):
        recomputed = L // checkpointing.k
        return ActivationEstimate(
            stored_bytes=recomputed * boundary + (L - recomputed) * layer + head,
            recompute_bytes=layer if recomputed else 0,
            formula=f"{recomputed}·p·sbh + {L - recomputed}·layer + head, + 1 recomputed layer",
        )
    if isinstance(checkpointing, SelectiveCheckpointing):
        return ActivationEstimate(stored_bytes=L * (layer - core) + head, recompute_bytes=core,
                                  formula="L·(layer − attention core) + head, + 1 recomputed core")
    raise TypeError(f"unknown checkpointing {checkpointing!r}")
