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

from launchers.workloads.trainable import TrainableSetupError

if TYPE_CHECKING:
    from torch import nn

FOUR_BIT_TAG = "dsopt_four_bit"
"""Attribute set on a parameter that transformers' quantizer turns 4-bit."""


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


def is_four_bit(param: Any) -> bool:
    """The parameter is a 4-bit weight: tagged by :func:`mark_four_bit`, or a real ``Params4bit``."""
    return bool(getattr(param, FOUR_BIT_TAG, False)) or type(param).__name__ == "Params4bit"


def quantize_(model: nn.Module, fields: dict[str, Any], *, device: Any) -> int:
    """Replace the 4-bit layers of ``model`` by ``bnb.nn.Linear4bit`` quantized from their current weights on
    ``device``, as transformers' loader does (``Linear4bit(in, out, bias, compute_dtype, compress_statistics,
    quant_type, quant_storage)``; a ``Conv1D`` weight is transposed first). The count replaced. TrainableSetupError
    without bitsandbytes."""
    try:
        import bitsandbytes as bnb
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
        new.weight = bnb.nn.Params4bit(weight.contiguous().to("cpu", torch.float32), requires_grad=False,
                                       quant_type=new.weight.quant_type, blocksize=new.weight.blocksize,
                                       compress_statistics=new.weight.compress_statistics,
                                       quant_storage=storage).to(device)
        if old.bias is not None:
            new.bias = torch.nn.Parameter(old.bias.detach().to(device), requires_grad=old.bias.requires_grad)
        new.requires_grad_(False)
        inner.set_submodule(name, new)
    return len(names)
