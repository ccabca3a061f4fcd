"""A frozen reference model beside the trained one (the study's ``training.reference_model``: DPO, distillation),
built and held as TRL holds it, and the objective dsopt's own step trains with it.

TRL 1.16 (``trl/trainer/dpo_trainer.py:908-929, 984-986``): without PEFT the reference is a second copy of the
model, loaded in the policy's dtype (``:924``) and wrapped by ``trl/models/utils.py`` ``prepare_deepspeed`` — the
training config without ``optimizer``, ``scheduler`` and ``zero_optimization.offload_optimizer``, at ZeRO stage 0
unless the training runs ZeRO-3 (then the copy is partitioned too), ``deepspeed.initialize`` with no optimizer,
``eval()``. (Its ``zero_optimization.reduce_bucket_size``-style dotted keys are set at the config's top level,
where DeepSpeed does not read them: the reference keeps the training's ZeRO-3 settings.) With PEFT there is no copy
(``:909-914``): the reference forward is the policy's with the adapters disabled (``:1328-1336``).

Each step runs the policy's forward first and the reference's after it, under ``torch.no_grad`` (``:1298``,
``:1327-1338``), so the reference's working memory comes on top of the policy's saved activations. dsopt's own step
trains the causal-LM loss anchored to the reference's, ``L + β·(L − L_ref)²`` (β = :data:`BETA`): one forward of
each per micro-batch in TRL's order, a gradient that depends on the reference. It is not DPO's loss (pairs of
sequences and TRL's fused LM head); a TRL script is planned as a script trial (``examples/trl_dpo``)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from launchers.models.deferred_compile import import_deferring_compile

BETA = 0.1
"""The anchor's weight in dsopt's objective with a reference (module doc)."""


def anchored(loss: torch.Tensor, reference_loss: torch.Tensor) -> torch.Tensor:
    """``L + β·(L − L_ref)²``: the policy's loss anchored to the reference's (``reference_loss`` has no gradient)."""
    return loss + BETA * (loss - reference_loss.to(loss.dtype)) ** 2


def reference_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config TRL's ``prepare_deepspeed`` gives the reference (module doc)."""
    config = copy.deepcopy(ds_config)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    zero = config.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    if zero.get("stage", 0) != 3:
        zero["stage"] = 0
    return config


def peft_model_of(model: nn.Module) -> Any | None:
    """The ``peft.PeftModel`` inside ``model`` (dsopt's wrapper holds it as ``.inner``), or None."""
    try:
        peft = import_deferring_compile("peft")  # not bitsandbytes' compiler (launchers/models/deferred_compile.py)
    except ImportError:
        return None
    return next((m for m in model.modules() if isinstance(m, peft.PeftModel)), None)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The forward of ``model`` with its PEFT adapters off (``PeftModel.disable_adapter``): the base model."""
    wrapped = peft_model_of(model)
    if wrapped is None:
        raise ValueError("training.reference_model with model.peft: the built model holds no PEFT model")
    with wrapped.disable_adapter():
        yield


def frozen_copy_spec(model_spec: dict[str, Any]) -> dict[str, Any]:
    """The reference's model spec: the model without adapters or freezing (every parameter is frozen anyway)."""
    return {k: v for k, v in model_spec.items() if k not in ("peft", "frozen", "reference_model")}


def freeze_all(model: nn.Module) -> nn.Module:
    """Every parameter frozen and the model in eval mode (no dropout), as TRL holds the reference."""
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()


def reference_forward(*, policy: nn.Module, reference: Callable[[torch.Tensor], torch.Tensor] | None,
                      batch: torch.Tensor) -> torch.Tensor:
    """The reference's loss on ``batch`` under ``torch.no_grad``: ``reference`` (a frozen copy's engine or module),
    or — with PEFT, ``reference`` None — ``policy`` with its adapters disabled."""
    with torch.no_grad():
        if reference is not None:
            return reference(batch)
        with adapters_disabled(policy):
            return policy(batch)


def reference_engine(plan: dict[str, Any], *, device: torch.device) -> Any | None:
    """The frozen reference copy as TRL's ``prepare_deepspeed`` holds it (module doc), for a rank:
    built in the training dtype (under ``zero.Init`` where the reference runs ZeRO-3), seeded as the policy was
    (the reference is the policy before training), its own engine with no optimizer, in eval mode. None with PEFT:
    the reference is the policy with its adapters disabled."""
    import deepspeed

    from launchers.models.builtin import build_workload

    if plan["model"].get("peft"):
        return None
    config = reference_config(plan["config"])
    construction = "zero_init" if config["zero_optimization"]["stage"] == 3 else "device"
    model, _ = build_workload(model_spec=frozen_copy_spec(plan["model"]), checkpointing="none",
                              sequence_length=plan["sequence_length"], seed=plan["seed"],
                              entry_point=plan.get("entry_point"), construction=construction, ds_config=config,
                              device=device)
    engine, *_ = deepspeed.initialize(model=freeze_all(model), config=config)
    engine.eval()
    return engine
