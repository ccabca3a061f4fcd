"""A QLoRA base's ledger items: the 4-bit weights where DeepSpeed holds them, and the weight each 4-bit matmul
dequantizes (pure; symbols as in :mod:`optimizer.ledger.model_states`, Ψ₄ the 4-bit weights' elements, L₄ the
largest of them).

* Below ZeRO-3 the 4-bit weights are frozen parameters outside the flat group (``stage_1_and_2.py:428-434``), whole
  on every rank; the engine's module cast (``engine.py:1851-1862``, ``module.bfloat16()``) leaves them alone
  (it casts floating tensors only; the study's storage dtype is uint8 or the training dtype). Their bytes are the
  packed weights and their quantization statistics (:func:`optimizer.ledger.quantized.four_bit_bytes`).
* At ZeRO-3 the packed ``Params4bit`` tensors, of the training dtype, are partitioned, gathered and kept persistent
  like any parameter (counted inside Q, LL and K: :func:`optimizer.ledger.transformer.held_tensors`); their
  statistics (``Params4bit.quant_state``: absmax, codebooks) are plain tensors, not parameters, and stay whole on
  every rank.
* Each 4-bit matmul dequantizes its weight (bitsandbytes 0.50 ``autograd/_functions.py`` ``MatMul4Bit``; the
  default kernel ``backends/default/ops.py`` ``_gemm_4bit_default_impl``): forward to the input's dtype (the
  compute dtype: ``nn/modules.py`` ``Linear4bit.forward`` casts the input to it), after dequantizing nested absmax
  to fp32; backward (``MatMul4Bit.backward``) to the dtype the weight was quantized from — the training dtype,
  as ``from_pretrained(dtype=...)`` loads it — then ``.to`` the gradient's dtype (the compute dtype). One weight at
  a time, freed after its matmul. A trace of the model emulates these allocations layer by layer
  (``launchers/models/four_bit.py`` ``emulate_four_bit_matmuls``), so the traced activations hold the dequantized
  weight exactly where it coexists with them (the activation peak is often at the LM head, which is not 4-bit);
  where the activations come from the formula, the largest one is added at the peak instead. ``MatMul4Bit`` saves
  the packed weight only (``ctx.tensors = (None, B)``), no input: a 4-bit Linear keeps for backward what a
  frozen Linear keeps, which is what the trace of the frozen base counts.

Not counted: the compute-dtype copy of a 4-bit layer's input where the compute dtype is not the training dtype
(``Linear4bit.forward``, ``x.to(self.compute_dtype)``), one input at a time.
"""

from __future__ import annotations

from optimizer.ledger.items import Category, LedgerItem, Location, Phase
from optimizer.ledger.state_sizes import FP32, _item, _Sizes
from optimizer.ledger.transformer import four_bit_weights
from optimizer.study.knobs import Candidate, ZeroStage
from optimizer.study.quantization_section import FourBitBase
from optimizer.study.specs import TransformerModel

BNB = "bitsandbytes 0.50"
"""The release the items' sources refer to."""


def held_items(z: _Sizes, candidate: Candidate) -> list[LedgerItem]:
    """The 4-bit weights' bytes on every rank (module doc); none without them."""
    if not z.four_bit:
        return []
    if candidate.zero_stage is ZeroStage.PARAMETERS:
        return [_item("4-bit quantization statistics (absmax, codebooks: not parameters, whole on every rank)",
                      Category.PARAMS, Location.GPU, z.four_bit_statistics, "statistics of Ψ₄",
                      f"{BNB} nn/modules.py Params4bit.quant_state; functional.py quantize_4bit")]
    return [_item("4-bit weights: packed + quantization statistics (frozen, whole on every rank)", Category.PARAMS,
                  Location.GPU, z.four_bit_bytes, "Ψ₄/2 + statistics",
                  f"{BNB} functional.py quantize_4bit; DeepSpeed stage_1_and_2.py:428-434")]


def dequantized_weight_bytes(model: TransformerModel, *, training_bytes: int) -> tuple[int, str]:
    """(bytes, formula) of the largest 4-bit weight dequantized for its matmul, the larger of forward's and
    backward's (module doc); (0, "") without a 4-bit base."""
    weights = four_bit_weights(model)
    if not weights.elements or model.quantization is None:
        return 0, ""
    base = FourBitBase.from_json(model.quantization)
    compute = base.compute_bytes
    nested = FP32 * weights.largest_blocks if base.double_quant else 0
    forward = compute * weights.largest + nested
    backward = training_bytes * weights.largest + (compute * weights.largest if compute != training_bytes else 0)
    if forward >= backward:
        return forward, f"{compute}·L₄" + (" + 4·L₄/64" if nested else "")
    return backward, f"{training_bytes}·L₄" + (f" + {compute}·L₄" if compute != training_bytes else "")


def dequantized_items(model: TransformerModel, candidate: Candidate, *, split: bool) -> list[LedgerItem]:
    """The dequantized weight beside the activations at their peak (``split``: in both of ZeRO-2's lines)."""
    num_bytes, formula = dequantized_weight_bytes(model, training_bytes=candidate.precision.bytes_per_element)
    if not num_bytes:
        return []
    phases = (Phase.FORWARD, Phase.BACKWARD) if split else (Phase.BACKWARD,)
    return [_item("largest 4-bit weight dequantized for its matmul (one at a time)", Category.BUFFERS, Location.GPU,
                  num_bytes, formula, f"{BNB} autograd/_functions.py MatMul4Bit; backends/default/ops.py "
                  "_gemm_4bit_default_impl", phase) for phase in phases]
