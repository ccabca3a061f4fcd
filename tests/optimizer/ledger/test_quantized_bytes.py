"""The bytes of a 4-bit weight (:mod:`optimizer.ledger.quantized`) against real bitsandbytes quantizations on the CPU
(bitsandbytes 0.50 quantizes, multiplies and back-propagates 4-bit weights there), by hand at the QLoRA paper's
figures, and every layout bitsandbytes refuses refused too."""

from __future__ import annotations

import pytest

from optimizer.ledger.quantized import four_bit_bytes


def _real_bytes(shape: tuple[int, int], *, double_quant: bool, storage: str, blocksize: int) -> tuple[int, int]:
    import torch
    from bitsandbytes.nn import Params4bit

    weight = Params4bit(torch.randn(*shape), requires_grad=False, quant_type="nf4", blocksize=blocksize,
                        compress_statistics=double_quant, quant_storage=getattr(torch, storage)).to("cpu")
    state = weight.quant_state
    parts = [state.absmax, state.code] + ([state.state2.absmax, state.state2.code, state.offset] if state.nested
                                          else [])
    return weight.numel() * weight.element_size(), sum(t.numel() * t.element_size() for t in parts)


@pytest.mark.parametrize("shape", [(64, 64), (100, 37), (4096, 11), (512, 1000)])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize(("storage", "size"), [("uint8", 1), ("bfloat16", 2), ("float32", 4)])
@pytest.mark.parametrize("blocksize", [64, 128])
def test_the_bytes_are_a_real_params4bit_quantizations(shape, double_quant, storage, size, blocksize):
    pytest.importorskip("bitsandbytes")
    elements = shape[0] * shape[1]
    try:
        real = _real_bytes(shape, double_quant=double_quant, storage=storage, blocksize=blocksize)
    except RuntimeError as err:  # bitsandbytes cannot view the packed bytes as that storage dtype
        assert "divisible" in str(err)
        with pytest.raises(ValueError, match="quant_storage"):
            four_bit_bytes(elements, blocksize=blocksize, double_quant=double_quant, storage_bytes=size)
        return
    ours = four_bit_bytes(elements, blocksize=blocksize, double_quant=double_quant, storage_bytes=size)
    assert (ours.packed, ours.statistics) == real


def test_per_element_the_qlora_figures():
    # 4096 × 11008 (a Llama-2-7B MLP weight): 0.5 + 4/64 = 0.5625 bytes per element without double quantization;
    # with it 0.5 + 1/64 + 4/(64·256) ≈ 0.5159 (Dettmers et al. 2023 §3: 0.127 bits of constants per parameter)
    n = 4096 * 11008
    assert four_bit_bytes(n).total / n == pytest.approx(0.5625, abs=1e-5)
    assert four_bit_bytes(n, double_quant=True).total / n == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256), abs=1e-4)
    assert (four_bit_bytes(n, double_quant=True).statistics - 4 - 64 - 1024) * 8 / n == pytest.approx(0.127, abs=1e-3)


@pytest.mark.parametrize(("kwargs", "why"), [({"blocksize": 48}, "blocksize"), ({"storage_bytes": 4}, "quant_storage")])
def test_a_layout_bitsandbytes_refuses_is_refused(kwargs, why):
    with pytest.raises(ValueError, match=why):
        four_bit_bytes(925 * 2 - 1, **kwargs)
