"""The trace's stand-in for a bitsandbytes 4-bit layer (``launchers.models.four_bit.emulate_four_bit_matmuls``)
allocates what the real ``bnb.nn.Linear4bit`` allocates: one forward + backward of each, on real CPU tensors, measured
by the live-tensor counter the trials use (``launchers.rank.cpu_memory``), for every compute/training dtype pair
and with or without nested quantization."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")

from launchers.models.four_bit import FOUR_BIT_TAG, emulate_four_bit_matmuls  # noqa: E402
from launchers.rank.cpu_memory import start_cpu_profiler, stop_cpu_profiler  # noqa: E402


def _peak(layer: torch.nn.Module, x: torch.Tensor) -> int:
    profiler = start_cpu_profiler()
    y = layer(x)
    y.float().sum().backward()
    del y
    return stop_cpu_profiler(profiler).peak


@pytest.mark.parametrize("training", ["bfloat16", "float32"])
@pytest.mark.parametrize("compute", ["bfloat16", "float32"])
@pytest.mark.parametrize("nested", [False, True])
def test_the_emulated_layer_peaks_where_the_real_one_does(training, compute, nested):
    dtype, compute_dtype = getattr(torch, training), getattr(torch, compute)
    torch.manual_seed(0)
    weight = torch.randn(1024, 256, dtype=dtype)
    real = bnb.nn.Linear4bit(256, 1024, bias=False, compute_dtype=compute_dtype, compress_statistics=nested,
                             quant_type="nf4", device="meta")
    real.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4", blocksize=64,
                                    compress_statistics=nested).to("cpu")
    stand_in = torch.nn.Linear(256, 1024, bias=False, dtype=dtype)
    stand_in.weight.data.copy_(weight)
    stand_in.weight.requires_grad_(False)
    setattr(stand_in.weight, FOUR_BIT_TAG, True)
    assert emulate_four_bit_matmuls(stand_in, {"bnb_4bit_compute_dtype": compute,
                                               "bnb_4bit_use_double_quant": nested}) == 1
    x = torch.randn(2, 8, 256, dtype=dtype, requires_grad=True)
    real_peak, stand_in_peak = _peak(real, x), _peak(stand_in, x.detach().clone().requires_grad_())
    # the dequantized weight (1 MB in fp32) dominates both; measured equal to the byte on an AMD EPYC
    assert real_peak > weight.numel() * 2
    assert abs(stand_in_peak - real_peak) <= 0.005 * real_peak, (stand_in_peak, real_peak)
