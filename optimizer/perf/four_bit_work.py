"""What a QLoRA base's 4-bit weights add to one optimizer step of one rank (pure).

bitsandbytes 0.50 (``autograd/_functions.py`` ``MatMul4Bit``; ``backends/default/ops.py``
``_gemm_4bit_default_impl``; ``nn/modules.py`` ``Linear4bit.forward``) runs each 4-bit Linear as: the input cast to
``bnb_4bit_compute_dtype``, the weight dequantized to that dtype, one ordinary GEMM; backward dequantizes the weight
again, to the dtype it was quantized from (the training dtype), casts it to the gradient's (compute) dtype and
multiplies — the input gradient only (a frozen weight has no weight gradient). So per token, with Ψ₄ 4-bit weight
elements, c the compute dtype's bytes and g the training dtype's:

* the GEMMs of the 4-bit weights — 2·Ψ₄ forward, 2·Ψ₄ input gradient, 2·Ψ₄·r recomputed (r the recomputed share
  of the blocks) — run at the compute dtype's FLOP rate: where it is not the training precision's, they move to
  the other rate (``bnb_4bit_compute_dtype: float32``, transformers' default, makes a bf16 QLoRA run its base
  matmuls at the fp32 peak);
* per micro-step, every 4-bit weight is dequantized once in forward (reads Ψ₄/2 packed bytes, writes c·Ψ₄), once
  more for each recomputed forward, and once in backward (Ψ₄/2 + g·Ψ₄, and g·Ψ₄ + c·Ψ₄ for the cast where g ≠ c):
  device-memory traffic, timed at the HBM bandwidth. The statistics (1/64 of the elements) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimizer.ledger.transformer import four_bit_weights
from optimizer.study.quantization_section import FourBitBase
from optimizer.study.specs import TransformerModel


@dataclass(frozen=True, kw_only=True, slots=True)
class FourBitWork:
    """The 4-bit weights' share of one optimizer step (all zero without ``model.quantization``)."""

    elements: int
    """Ψ₄."""
    packed_bytes: int
    """Ψ₄'s packed bytes (⌈n/2⌉ per weight): what ZeRO-3 gathers and parameter offload moves for them."""
    other_precision_flops: float
    """FLOPs of the 4-bit GEMMs that run at the other precision's rate than the training one."""
    dequant_bytes: float
    """Device-memory bytes of the dequantizations."""


def four_bit_work(*, model: TransformerModel, training_bytes: int, tokens: int, micro_steps: int,
                  recomputed: float) -> FourBitWork:
    """:class:`FourBitWork` of one optimizer step: ``tokens`` per rank in ``micro_steps`` micro-steps, ``recomputed``
    the share of the blocks' forward run again (module doc)."""
    weights = four_bit_weights(model)
    if not weights.elements or model.quantization is None:
        return FourBitWork(elements=0, packed_bytes=0, other_precision_flops=0.0, dequant_bytes=0.0)
    psi4 = weights.elements
    compute = FourBitBase.from_json(model.quantization).compute_bytes
    other = (compute == 4) != (training_bytes == 4)
    gemm_flops = tokens * 2 * psi4 * (2 + recomputed)
    forward = psi4 / 2 + compute * psi4
    backward = psi4 / 2 + training_bytes * psi4 + ((training_bytes + compute) * psi4
                                                   if training_bytes != compute else 0)
    return FourBitWork(elements=psi4, packed_bytes=weights.packed_bytes,
                       other_precision_flops=gemm_flops if other else 0.0,
                       dequant_bytes=micro_steps * (forward * (1 + recomputed) + backward))
