"""The reference model's items (the study's ``training.reference_model``), held as TRL 1.16 holds it (pure).

``trl/trainer/dpo_trainer.py:908-929, 984-986`` and ``trl/models/utils.py`` ``prepare_deepspeed``: a second copy of
the model, in the policy's dtype (``dpo_trainer.py:924``), wrapped by ``deepspeed.initialize`` with no optimizer —
ZeRO stage 0 (every parameter whole on every rank) unless the training runs ZeRO-3, where the copy is partitioned
like any ZeRO-3 model (DeepSpeed 0.19.8 ``engine.py`` builds ``DeepSpeedZeRoOffload`` for a stage-3 engine without an
optimizer: the partition, the persistent small tensors, what is gathered for its forward) and
``offload_param`` still applies (``offload_optimizer`` is dropped). No gradient, master copy or optimizer state
exists for it. With ``model.peft`` TRL makes no copy: the reference is the policy with its adapters disabled
(``dpo_trainer.py:909-914, 1328-1336``), so only its forward's working memory remains — which the traced step
holds (:mod:`launchers.models.reference`: the reference's forward runs after the policy's, under no_grad, on
top of the policy's saved activations)."""

from __future__ import annotations

from optimizer.deepspeed.zero_settings import (
    DEEPSPEED_PARAM_SWAP_BUFFER_ELEMENTS,
    DEEPSPEED_PARAM_SWAP_BUFFERS,
    ZeroSettings,
)
from optimizer.ledger.items import Category, LedgerItem, Location, Phase
from optimizer.ledger.state_sizes import DS, _item, _place, _Sizes
from optimizer.study.knobs import Candidate, OffloadDevice, ZeroStage
from optimizer.study.specs import TransformerModel

TRL = "TRL 1.16 trl/models/utils.py prepare_deepspeed; trl/trainer/dpo_trainer.py:908-929, 984-986"
"""Where the reference's placement comes from."""


def reference_items(z: _Sizes, candidate: Candidate, settings: ZeroSettings,
                    model: TransformerModel, *, joint_bytes: int | None = None) -> list[LedgerItem]:
    """The frozen reference copy's per-rank items (module doc); none without ``training.reference_model`` or with
    ``model.peft`` (no copy). ``joint_bytes``: at ZeRO-3, what the copy's own coordinator, replayed over its traced
    forward, holds gathered at the moment the activations and every gathered parameter together peak
    (:meth:`optimizer.study.traced_activation.TracedActivation.zero3_joint_at`; None or 0: not traced so — a trace
    extended from shallow copies has none —, the formula)."""
    if not model.reference_model or model.peft is not None:
        return []
    g, prec = z.g, candidate.precision
    if candidate.zero_stage is not ZeroStage.PARAMETERS:
        return [_item(f"reference model: {prec} parameters (frozen copy, ZeRO stage 0: whole on every rank)",
                      Category.PARAMS, Location.GPU, g * z.psi, f"{g}Ψ", f"{TRL}; {DS} engine.py:1851-1862")]
    param = candidate.offload_param
    items = [_item(f"reference model: {prec} parameter partition{' (pinned)' if param is OffloadDevice.CPU else ''}",
                   Category.PARAMS, _place(param), g * z.q, f"{g}Q", f"{TRL}; {DS} partition_parameters.py:1690-1696"),
             _item("reference model: persistent parameters", Category.PARAMS, Location.GPU, g * z.k, f"{g}K",
                   f"{DS} parameter_offload.py:317-330")]
    if param is OffloadDevice.NVME:
        items.append(_item("reference model: parameter swap buffers", Category.BUFFERS, Location.HOST,
                           DEEPSPEED_PARAM_SWAP_BUFFERS * DEEPSPEED_PARAM_SWAP_BUFFER_ELEMENTS * g, f"5·1e8·{g}",
                           f"{DS} swap_tensor/partitioned_param_swapper.py:104-127"))
    cap = settings.max_live_parameters + z.largest_module
    if (z.n > 1 or param is not OffloadDevice.NONE) and joint_bytes:
        # Its own coordinator, whose trace is its forward alone: the prefetch front runs ahead of the modules and
        # what it fetched is held until its module runs (launchers/trace/zero3_held.py reference_held, measured)
        items.append(_item("reference model: parameters gathered or in flight where they, the policy's and the "
                           "activations together peak (its coordinator replayed over its traced forward)",
                           Category.BUFFERS, Location.GPU, min(joint_bytes, g * cap),
                           "traced: each tensor in its own dtype",
                           f"{DS} partitioned_param_coordinator.py:420-476, 634-665 "
                           "(optimizer/deepspeed/zero3_gather.py)", Phase.BACKWARD))
    elif z.n > 1 or param is not OffloadDevice.NONE:
        # Not traced at full depth (or the copy held nothing at the traced moment): its coordinator's trace is its
        # forward alone, and each fetch pops at least one more entry for prefetch while fewer than max_live elements
        # are available (:452-476), so the front runs ahead and holds what it fetched until max_live stops it — all
        # of the copy's non-persistent parameters in a small model (96,256 of 124,928 at one moment on the tiny
        # Llama, measured), max_live and the module at hand in a large one (a 70B layer's weights are ~0.9e9
        # elements: the front passes 1e9 a few blocks in). The policy's activations are held meanwhile.
        gathered = min(z.psi - z.k, cap)
        items.append(_item("reference model: parameters gathered or in flight for its forward (its prefetch front, "
                           "up to max_live)", Category.BUFFERS, Location.GPU, g * gathered,
                           f"{g}·min(Ψ − K, max_live + LL)", f"{DS} partitioned_param_coordinator.py:420-476",
                           Phase.BACKWARD))
    return items
