"""Bytes of a bitsandbytes 4-bit weight (QLoRA's base), as ``bitsandbytes`` 0.50 stores it (pure).

``bitsandbytes/functional.py`` ``quantize_4bit`` (called by ``nn.Params4bit._quantize`` when the weight moves to its
device): the weight's n elements packed two per byte into ``quant_storage`` elements (``backends/default/ops.py:258``
views the ⌈n/2⌉ bytes as that dtype: they must divide by its size), one absmax per ``blocksize`` elements in fp32,
and the 16-entry fp32 codebook of the quant type (``get_4bit_type``, a tensor of its own per weight). With
``compress_statistics`` (``bnb_4bit_use_double_quant``) the absmax are quantized again, blockwise by 256
(``quantize_blockwise``): one byte each, plus their own fp32 absmax per 256, a 256-entry fp32 codebook and one fp32
offset. Per element: 0.5 + 4/64 = 0.5625 bytes without double quantization, ≈ 0.516 with it (the QLoRA paper's
0.127 bits per parameter of constants, Dettmers et al. 2023 §3). Planned where a study has ``model.quantization``
(:mod:`optimizer.study.quantization_section`); checked against real ``Params4bit`` quantizations by
``tests/optimizer/ledger/test_quantized_bytes.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""The blocksizes ``quantize_4bit`` accepts (64 is transformers' and bitsandbytes' default)."""
CODEBOOK_4BIT = 16 * 4
"""The nf4/fp4 codebook: 16 fp32 values."""
NESTED_BLOCK = 256
"""``quantize_blockwise``'s blocksize for the absmax under double quantization."""
CODEBOOK_8BIT = 256 * 4
"""The dynamic 8-bit codebook of the nested absmax: 256 fp32 values."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FourBitBytes:
    """One 4-bit weight's bytes, by part."""

    packed: int
    """The packed weight (the ``Params4bit`` tensor itself)."""
    statistics: int
    """Its quantization state: absmax (and, nested, their state), codebooks, offset."""

    @property
    def total(self) -> int:
        """Everything the weight holds on its device."""
        return self.packed + self.statistics


def packed_elements(elements: int, *, storage_bytes: int) -> int:
    """Elements of the ``Params4bit`` tensor itself: ⌈n/2⌉ packed bytes viewed as ``storage_bytes``-byte elements
    (rounded up where bitsandbytes would refuse the view: a plan never crashes on an odd shape)."""
    packed = -(-elements // 2)
    return -(-packed // storage_bytes)


def four_bit_bytes(elements: int, *, blocksize: int = 64, double_quant: bool = False,
                   storage_bytes: int = 1) -> FourBitBytes:
    """The bytes of a weight of ``elements`` quantized to 4 bits (module doc); ``storage_bytes``: the element size of
    ``bnb_4bit_quant_storage`` (uint8 1, bf16/fp16 2, fp32 4). ValueError where bitsandbytes refuses the layout."""
    if elements < 1:
        raise ValueError(f"a weight has at least one element, got {elements}")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {BLOCKSIZES}, got {blocksize}")
    packed = -(-elements // 2)
    if packed % storage_bytes:
        raise ValueError(f"{packed} packed bytes do not divide into {storage_bytes}-byte quant_storage elements")
    blocks = -(-elements // blocksize)
    if double_quant:
        statistics = blocks + 4 * -(-blocks // NESTED_BLOCK) + CODEBOOK_8BIT + 4 + CODEBOOK_4BIT
    else:
        statistics = 4 * blocks + CODEBOOK_4BIT
    return FourBitBytes(packed=packed, statistics=statistics)
