"""What trains, applied to a built model: ``training.frozen``'s globs and ``model.peft``'s LoRA adapters
(:mod:`optimizer.study.peft_section`), as a user's script applies them — the parameters the globs match get
``requires_grad = False``, then ``peft.get_peft_model`` wraps the model (PEFT freezes the base itself:
``tuners/tuners_utils.py`` ``_mark_only_adapters_as_trainable``).

One function for every place that builds the model — the trial's ranks (after the construction context: a
script adds adapters to the model ``from_pretrained`` returned, outside ``zero.Init``), the fake-tensor traces and
the parameter inventory — so the ledger plans, and the trial measures, the same model.

Names are the model's own: for a ``transformers`` config the library's (``model.layers.0.self_attn.q_proj``;
the globs match the transformers model's ``named_parameters()``, LoRA's ``target_modules`` its module names);
for dsopt's built-in GPT its own (``layers.0.attn.q``, docs/study-file.md). A glob or a target that matches
nothing is :class:`TrainableSetupError`: the study would train something else than its author meant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from launchers.models.deferred_compile import import_deferring_compile
from launchers.models.setup_error import TrainableSetupError
from optimizer.study.peft_section import frozen_by, unmatched_patterns

if TYPE_CHECKING:  # torch only where a model is at hand: launchers.trace.inventory reads a cached inventory without it
    from torch import nn


def _base(model: nn.Module) -> nn.Module:
    """The module whose names the study's globs and targets use: a transformers model inside dsopt's loss
    wrapper (:class:`launchers.models.hf_model.HfCausalLM`), else the model itself."""
    return getattr(model, "inner", model)


def freeze(model: nn.Module, patterns: list[str] | tuple[str, ...]) -> None:
    """``requires_grad = False`` on every parameter whose name matches a glob (TrainableSetupError for a glob
    that matches none)."""
    base = _base(model)
    names = [name for name, _ in base.named_parameters(remove_duplicate=False)]
    missing = unmatched_patterns(tuple(patterns), names)
    if missing:
        sample = ", ".join(names[:4])
        raise TrainableSetupError("training.frozen", f"{missing[0]!r} matches no parameter of the model (its names "
                                  f"look like {sample}, …)")
    for name, param in base.named_parameters(remove_duplicate=False):
        if frozen_by(tuple(patterns), name):
            param.requires_grad_(False)


def lora_config(fields: dict[str, Any], *, causal_lm: bool) -> Any:
    """``peft.LoraConfig`` of the study's checked fields (``task_type`` only for a transformers model, whose
    PEFT wrapper is ``PeftModelForCausalLM``; dsopt's GPT and an entry point's model get the plain wrapper)."""
    try:
        peft = import_deferring_compile("peft")  # not bitsandbytes' compiler (launchers/models/deferred_compile.py)
    except ImportError:
        raise TrainableSetupError("model.peft", "needs the peft package (pip install peft)") from None
    settings = dict(fields)
    settings.pop("peft_type", None)
    if not causal_lm:
        settings.pop("task_type", None)
    return peft.LoraConfig(**settings)


@contextlib.contextmanager
def no_op_moves_skipped() -> Iterator[None]:
    """``Module.to`` returns the module at once where every tensor already has the asked device and dtype.

    PEFT moves each new adapter to its base layer's device and dtype (``tuners_utils.py``
    ``_move_adapter_to_device_of_base_layer``); on fake tensors torch 2.13's ``Module._apply`` swaps every
    parameter and fails ("Couldn't swap Linear.weight") even when nothing moves. A move that moves something runs
    as before."""
    import torch
    from torch import nn

    original = nn.Module.to

    def to(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if memory_format is None and all(
                (device is None or t.device == device) and (dtype is None or not t.is_floating_point()
                                                            or t.dtype == dtype) for t in tensors):
            return module
        return original(module, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


def add_adapters(model: nn.Module, fields: dict[str, Any], *, as_deepspeed_casts: bool = False) -> nn.Module:
    """The model with LoRA adapters (``peft.get_peft_model``); TrainableSetupError where PEFT finds no target.

    PEFT keeps the adapters of a bf16/fp16 model in fp32 (``autocast_adapter_dtype=True``, its default), and a
    script's model gets them so; DeepSpeed then casts every parameter to the training dtype, adapters included
    (``engine.py:1859-1862``). ``as_deepspeed_casts``: make them in the model's dtype at once, as they train under
    DeepSpeed — for the fake-tensor trace, which has no engine to cast them (else every adapter's fp32 input copy
    would be counted as kept for backward)."""
    from torch import nn

    peft = import_deferring_compile("peft")

    base = _base(model)
    config = lora_config(fields, causal_lm=base is not model)
    try:
        with no_op_moves_skipped():
            wrapped = peft.get_peft_model(base, config, autocast_adapter_dtype=not as_deepspeed_casts)
    except ValueError as err:  # "Target modules {...} not found in the base model."
        names = sorted({name.rsplit(".", 1)[-1] for name, m in base.named_modules() if isinstance(m, nn.Linear)})
        raise TrainableSetupError("model.peft.target_modules", f"{err} (its linear layers: {', '.join(names[:12])}"
                                  f"{', …' if len(names) > 12 else ''})") from None
    if base is model:
        return wrapped
    model.inner = wrapped
    return model


def apply_trainable(model: nn.Module, model_spec: dict[str, Any], *, as_deepspeed_casts: bool = False) -> nn.Module:
    """``model`` as the study trains it: frozen by ``model_spec["frozen"]``, adapters by ``model_spec["peft"]``
    (:func:`launchers.trial.run.model_dict`; ``as_deepspeed_casts``: :func:`add_adapters`); a full fine-tune's model
    comes back as it is. A 4-bit base (``model_spec["quantization"]``) has its quantized layers frozen and tagged
    first (:func:`launchers.models.four_bit.mark_four_bit`), as ``from_pretrained`` hands them to the script."""
    if model_spec.get("quantization"):
        from launchers.models.four_bit import mark_four_bit

        mark_four_bit(model, model_spec["quantization"])
    if model_spec.get("frozen"):
        freeze(model, model_spec["frozen"])
    if model_spec.get("peft"):
        model = add_adapters(model, model_spec["peft"], as_deepspeed_casts=as_deepspeed_casts)
    if not any(p.requires_grad for p in model.parameters()):
        raise TrainableSetupError("training.frozen", "no parameter of the model trains (DeepSpeed would raise "
                                  "IndexError at stage_1_and_2.py:442 on an empty group)")
    return model


def zero_lora_b_(model: nn.Module, model_spec: dict[str, Any]) -> None:
    """LoRA's B matrices back to zero after dsopt's seeded draw of every Linear (PEFT starts them at zero,
    ``tuners/lora/layer.py`` ``reset_lora_parameters``, so the adapted model starts as the base model), unless
    the study's ``init_lora_weights`` is false."""
    peft_fields = model_spec.get("peft")
    if not peft_fields or peft_fields.get("init_lora_weights") is False:
        return
    for name, module in model.named_modules():
        if name.endswith("lora_B"):
            for param in module.parameters():
                param.data.zero_()


def adapter_parameters(model: nn.Module) -> set[int]:
    """The ids of the PEFT adapters' own tensors in ``model``: those ``get_peft_model`` upcasts to fp32 in a bf16 or
    fp16 model (``autocast_adapter_dtype=True``, its default) — every parameter kept under an adapter's name in a
    tuner layer's ``ModuleDict``/``ParameterDict`` (``lora_A``, ``lora_B``, DoRA's ``lora_magnitude_vector``), the
    walk of ``peft/tuners/tuners_utils.py:2729-2750`` (``cast_adapter_dtype``). Empty when PEFT was not imported."""
    import sys

    if "peft" not in sys.modules:
        return set()
    from peft.tuners.tuners_utils import BaseTunerLayer
    from torch import nn

    out: set[int] = set()
    for module in model.modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        for sub in module.modules():
            if isinstance(sub, nn.ModuleDict):
                out.update(id(p) for name in sub for p in sub[name].parameters())
            elif isinstance(sub, nn.ParameterDict):
                out.update(id(sub[name]) for name in sub)
    return out
