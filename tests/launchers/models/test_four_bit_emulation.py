"""The trace's stand-in for a bitsandbytes 4-bit layer (``launchers.models.four_bit.emulate_four_bit_matmuls``)
allocates what the real ``bnb.nn.Linear4bit`` allocates: one forward + backward of each, on real CPU tensors, measured
by the live-tensor counter the trials use (``launchers.measure.cpu_memory``), for every compute/training dtype pair
and with or without nested quantization."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")

from launchers.measure.cpu_memory import start_cpu_profiler, stop_cpu_profiler  # noqa: E402
from launchers.models.four_bit import FOUR_BIT_TAG, HELD_TAG, emulate_four_bit_matmuls  # noqa: E402


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


def _node_with_tensors(tensor: torch.Tensor):
    """The MatMul4Bit node behind ``tensor`` (the one whose context has ``tensors``)."""
    todo = [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None:
            continue
        if hasattr(node, "tensors"):
            return node
        todo.extend(next_node for next_node, _ in node.next_functions)
    raise AssertionError("no MatMul4Bit node")


@pytest.mark.parametrize("needs_grad", [True, False])
def test_the_real_matmul_keeps_the_packed_weight_past_a_release_and_the_stand_in_says_when(needs_grad):
    # bitsandbytes 0.50.2 autograd/_functions.py:357-358: ctx.tensors = (None, B) when an input needs a gradient — a
    # node attribute, not a saved tensor: ZeRO-3's release (param.data = torch.empty(0), partition_parameters.py:329)
    # and backward leave it, and the storage lives while the graph does (optimizer/deepspeed/zero3_gather.py)
    real = bnb.nn.Linear4bit(256, 1024, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
    real.weight = bnb.nn.Params4bit(torch.randn(1024, 256, dtype=torch.bfloat16), requires_grad=False,
                                    quant_type="nf4", blocksize=64).to("cpu")
    packed = real.weight.data.untyped_storage().data_ptr()
    x = torch.randn(2, 8, 256, dtype=torch.bfloat16, requires_grad=needs_grad)
    y = real(x)
    node = _node_with_tensors(y) if needs_grad else None
    real.weight.data = torch.empty(0, dtype=real.weight.dtype)  # released as ZeRO-3 releases it
    if needs_grad:
        y.float().sum().backward()
        assert node.tensors[1].untyped_storage().data_ptr() == packed  # still the forward's packed weight
    stand_in = torch.nn.Linear(256, 1024, bias=False, dtype=torch.bfloat16)
    stand_in.weight.requires_grad_(False)
    setattr(stand_in.weight, FOUR_BIT_TAG, True)
    emulate_four_bit_matmuls(stand_in, {"bnb_4bit_compute_dtype": "bfloat16"})
    stand_in(x.detach().requires_grad_(needs_grad))
    assert getattr(stand_in.weight, HELD_TAG, False) is needs_grad
    with torch.no_grad():  # a reentrant checkpoint's first forward: nothing kept
        fresh = torch.nn.Linear(256, 1024, bias=False, dtype=torch.bfloat16).requires_grad_(False)
        setattr(fresh.weight, FOUR_BIT_TAG, True)
        emulate_four_bit_matmuls(fresh, {"bnb_4bit_compute_dtype": "bfloat16"})
        fresh(x.detach().requires_grad_(True))
    assert not getattr(fresh.weight, HELD_TAG, False)
