"""A 4-bit base (QLoRA, the study's ``model.quantization``) applied to a built transformers model, as
``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` applies it.

:func:`four_bit_module_names` is transformers' own rule (``quantizers/quantizer_bnb_4bit.py``
``_process_model_before_weight_loading`` → ``integrations/bitsandbytes.py`` ``replace_with_bnb_linear``): every
``nn.Linear`` (exactly that class) and GPT-2's ``Conv1D``, except the modules ``get_modules_to_not_convert`` names —
the output embedding, the last parameter's module and tied weights when ``llm_int8_skip_modules`` is not given, those
modules alone when it is, and the model's ``_keep_in_fp32_modules`` — matched by ``should_convert_module``.

:func:`mark_four_bit` freezes those weights and tags them (the parameter inventory reads the tag, on fake tensors:
nothing is quantized there, and a frozen Linear saves for backward what a frozen 4-bit Linear saves, its input not
at all — ``bitsandbytes/autograd/_functions.py`` ``MatMul4Bit.forward`` keeps the packed weight only).
:func:`quantize_` makes them real ``bnb.nn.Linear4bit`` layers holding ``Params4bit`` weights, quantized from the
built weights when moved to the device (``nn/modules.py`` ``Params4bit._quantize``): what dsopt's own trial trains.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launchers.models.deferred_compile import import_deferring_compile
from launchers.models.setup_error import TrainableSetupError

if TYPE_CHECKING:
    from torch import nn

FOUR_BIT_TAG = "dsopt_four_bit"
"""Attribute set on a parameter that transformers' quantizer turns 4-bit."""
HELD_TAG = "dsopt_held_by_autograd"
"""Set on a 4-bit weight whose matmul kept it for backward in a forward outside backward (the trace's
:func:`emulate_four_bit_matmuls`): ``MatMul4Bit`` keeps it as a node attribute when an input needs a gradient
(bitsandbytes 0.50.2 ``autograd/_functions.py:357-358``), which ZeRO-3's release does not free
(:mod:`optimizer.deepspeed.zero3_gather`)."""


def _transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model inside dsopt's loss wrapper (``HfCausalLM.inner``)."""
    return getattr(model, "inner", model)


def four_bit_module_names(model: nn.Module, fields: dict[str, Any]) -> list[str]:
    """Names (in the transformers model) of the layers a ``BitsAndBytesConfig`` with ``fields`` makes 4-bit."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    inner = _transformers_model(model)
    skip = list(fields.get("llm_int8_skip_modules") or []) or None
    not_convert = HfQuantizer.get_modules_to_not_convert(inner, skip, getattr(inner, "_keep_in_fp32_modules", None))
    return [name for name, module in inner.named_modules()
            if (isinstance(module, Conv1D) or type(module) is nn.Linear) and should_convert_module(name, not_convert)]


def mark_four_bit(model: nn.Module, fields: dict[str, Any]) -> list[str]:
    """Freeze and tag the weights of the layers :func:`four_bit_module_names` names (transformers makes them
    ``requires_grad = False``: ``replace_with_bnb_linear``); their names. TrainableSetupError when there is none."""
    inner = _transformers_model(model)
    if any(type(m).__name__ == "Linear4bit" for m in inner.modules()):
        return []  # quantized already (:func:`quantize_`): bitsandbytes froze them
    names = four_bit_module_names(model, fields)
    if not names:
        raise TrainableSetupError("model.quantization", "transformers' quantizer converts no layer of this model "
                                  "(no nn.Linear or Conv1D outside llm_int8_skip_modules)")
    for name in names:
        module = inner.get_submodule(name)
        module.requires_grad_(False)  # the bias too, as replace_with_bnb_linear freezes the whole new module
        setattr(module.weight, FOUR_BIT_TAG, True)
    return names


class _FourBitMatmul:
    """Built lazily (torch is imported where a model is at hand): see :func:`emulate_four_bit_matmuls`."""

    function: Any = None

    @classmethod
    def get(cls) -> Any:
        if cls.function is None:
            import torch

            class FourBitMatmul(torch.autograd.Function):
                """``MatMul4Bit`` as bitsandbytes 0.50 allocates (module doc of :func:`emulate_four_bit_matmuls`)."""

                @staticmethod
                def forward(ctx: Any, x: Any, weight: Any, bias: Any, state_dtype: Any, blocks: int) -> Any:
                    if blocks:  # nested absmax dequantized to fp32 first (_gemm_4bit_default_impl)
                        absmax = torch.empty(blocks, dtype=torch.float32, device=x.device)
                    dequantized = weight.detach().to(x.dtype, copy=True)  # dequantize_4bit to A.dtype: a new tensor
                    out = torch.nn.functional.linear(x, dequantized, None if bias is None else bias.to(x.dtype))
                    del dequantized
                    if blocks:
                        del absmax
                    ctx.save_for_backward(weight)  # ctx.tensors = (None, B): the weight only, no input
                    ctx.state_dtype = state_dtype
                    ctx.blocks = blocks
                    ctx.has_bias = bias is not None and bias.requires_grad
                    return out

                @staticmethod
                def backward(ctx: Any, grad: Any) -> Any:
                    (weight,) = ctx.saved_tensors
                    if ctx.blocks:  # functional.dequantize_4bit: the nested absmax to fp32 again
                        absmax = torch.empty(ctx.blocks, dtype=torch.float32, device=grad.device)
                    dequantized = weight.detach().to(ctx.state_dtype, copy=True)  # dequantize_4bit returns,
                    if ctx.blocks:                                                 # its absmax freed,
                        del absmax
                    dequantized = dequantized.to(grad.dtype)                       # then .to the gradient's
                    grad_x = grad.matmul(dequantized)
                    grad_bias = grad.sum(tuple(range(grad.dim() - 1))) if ctx.has_bias else None
                    return grad_x, None, grad_bias, None, None

            cls.function = FourBitMatmul
        return cls.function


def emulate_four_bit_matmuls(model: nn.Module, fields: dict[str, Any]) -> int:
    """Make every tagged 4-bit layer of a fake-tensor model allocate what bitsandbytes 0.50's 4-bit layer allocates,
    for the trace: ``Linear4bit.forward`` (``nn/modules.py``) casts its input to the compute dtype and its output
    back; ``MatMul4Bit`` (``autograd/_functions.py``) dequantizes the weight to the input's dtype for the GEMM (after
    the nested absmax to fp32, ``backends/default/ops.py`` ``_gemm_4bit_default_impl``), keeps no input for
    backward, and in backward dequantizes again to the weight's own dtype (the training dtype it was quantized from)
    and casts it to the gradient's. So the trace sees the dequantized weight exactly when it coexists with the
    activations. The count of layers."""
    import torch
    from transformers.pytorch_utils import Conv1D

    compute = getattr(torch, fields.get("bnb_4bit_compute_dtype", "float32"))
    blocksize = 64
    function = _FourBitMatmul.get()
    count = 0
    for module in model.modules():
        weight = module._parameters.get("weight")  # its own: PEFT's wrapper forwards .weight to its base layer
        if weight is None or not getattr(weight, FOUR_BIT_TAG, False):
            continue
        conv1d = isinstance(module, Conv1D)
        blocks = -(-weight.numel() // blocksize) if fields.get("bnb_4bit_use_double_quant") else 0

        def forward(x: Any, *, layer: Any = module, conv: bool = conv1d, nested: int = blocks) -> Any:
            w = layer.weight.t() if conv else layer.weight
            out = function.apply(x.to(compute), w, layer.bias, layer.weight.dtype, nested)
            if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad) \
                    and torch._C._current_autograd_node() is None:  # kept for backward, in forward proper
                setattr(layer.weight, HELD_TAG, True)
            return out.to(x.dtype)

        module.forward = forward
        count += 1
    return count


def is_four_bit(param: Any) -> bool:
    """The parameter is a 4-bit weight: tagged by :func:`mark_four_bit`, or a real ``Params4bit``."""
    return bool(getattr(param, FOUR_BIT_TAG, False)) or type(param).__name__ == "Params4bit"


def quantize_(model: nn.Module, fields: dict[str, Any], *, device: Any) -> int:
    """Replace the 4-bit layers of ``model`` by ``bnb.nn.Linear4bit`` quantized from their current weights on
    ``device``, as transformers' loader does (``Linear4bit(in, out, bias, compute_dtype, compress_statistics,
    quant_type, quant_storage)``; a ``Conv1D`` weight is transposed first). The count replaced. TrainableSetupError
    without bitsandbytes."""
    try:
        bnb = import_deferring_compile("bitsandbytes")  # its kernels compiled where first run (deferred_compile.py)
    except ImportError:
        raise TrainableSetupError("model.quantization", "needs the bitsandbytes package (pip install "
                                  "bitsandbytes)") from None
    import torch
    from transformers.pytorch_utils import Conv1D

    inner = _transformers_model(model)
    compute = getattr(torch, fields.get("bnb_4bit_compute_dtype", "float32"))
    storage = getattr(torch, fields.get("bnb_4bit_quant_storage", "uint8"))
    names = four_bit_module_names(model, fields)
    for name in names:
        old = inner.get_submodule(name)
        weight = old.weight.detach()
        if isinstance(old, Conv1D):
            weight = weight.t()
        out_features, in_features = weight.shape
        new = bnb.nn.Linear4bit(in_features, out_features, old.bias is not None, compute_dtype=compute,
                                compress_statistics=bool(fields.get("bnb_4bit_use_double_quant")),
                                quant_type=fields.get("bnb_4bit_quant_type", "fp4"), quant_storage=storage,
                                device="meta")
        # quantized from the weight in the dtype it was built in (the training dtype, as from_pretrained(dtype=...)
        # loads it): the quant_state's dtype, which backward dequantizes to (MatMul4Bit.backward)
        new.weight = bnb.nn.Params4bit(weight.contiguous().to("cpu"), requires_grad=False,
                                       quant_type=new.weight.quant_type, blocksize=new.weight.blocksize,
                                       compress_statistics=new.weight.compress_statistics,
                                       quant_storage=storage).to(device)
        if old.bias is not None:
            new.bias = torch.nn.Parameter(old.bias.detach().to(device), requires_grad=old.bias.requires_grad)
        new.requires_grad_(False)
        inner.set_submodule(name, new)
    return len(names)
