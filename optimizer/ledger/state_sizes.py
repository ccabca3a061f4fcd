"""The element counts and item constructor the model-state items share (pure): Ψ, Ψtr, P, Σ, Q, Qtr, S, K, Lₜ,
LL, LLtr, B, T and GAS of one candidate, as :mod:`optimizer.ledger.model_states`' docstring defines them."""

from __future__ import annotations

from dataclasses import dataclass

from optimizer.deepspeed.versions import LEDGER_DEEPSPEED_VERSION
from optimizer.deepspeed.zero_settings import ZeroSettings
from optimizer.ledger.items import Category, LedgerItem, Location, Phase
from optimizer.ledger.transformer import (
    four_bit_weights,
    largest_layer_parameters,
    largest_tensor_parameters,
    parameter_count,
    parameter_tensors,
    persistent_parameters,
    tied_copy_elements,
    trainable_count,
    zero3_partition_elements,
    zero12_partition,
)
from optimizer.study.constraints import adapters_kept_fp32, gradient_accumulation_steps
from optimizer.study.knobs import Candidate, OffloadDevice
from optimizer.study.specs import HardwareSpec, TrainingSpec, TransformerModel

DS = f"DeepSpeed {LEDGER_DEEPSPEED_VERSION}"
"""The release the items' file:line sources refer to (:mod:`optimizer.deepspeed.versions`)."""
STAGE12 = f"{DS} runtime/zero/stage_1_and_2.py"
STAGE3 = f"{DS} runtime/zero/stage3.py"
FP32 = 4
ADAM_STATE_BYTES = 8
"""exp_avg + exp_avg_sq, FP32 (the dtype of the master weights)."""
STAGE0_ALLREDUCE_ELEMENTS = 500_000_000
"""``MEMORY_OPT_ALLREDUCE_SIZE`` (``engine.py:151``): stage 0 flattens gradients in chunks this large."""
OFFLOAD_NORM_CHUNK = 250_000_000
"""ZeRO-3's ``_constant_buffered_norm2`` converts at most this many elements to fp64 at once
(``stage3.py:1960-1967``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Sizes:
    """The element counts every formula below uses."""

    psi: int
    n: int
    g: int
    padded: int
    p: int
    sigma: int
    piece: int
    q: int
    s: int
    k: int
    largest_tensor: int
    largest_module: int
    tied: int
    bucket: int
    gas: int
    trainable: int = -1
    """Ψtr (default Ψ: a full fine-tune)."""
    q_trainable: int = -1
    """Qtr (default Q)."""
    largest_module_grad: int = -1
    """LLtr (default LL)."""
    four_bit: int = 0
    """Ψ₄: elements of a QLoRA base's 4-bit weights (part of Ψ − Ψtr; 0 without ``model.quantization``)."""
    four_bit_bytes: int = 0
    """Their bytes whole: packed weights + quantization statistics."""
    four_bit_statistics: int = 0
    """The statistics alone (absmax, codebooks): not parameters, never partitioned."""
    q_adapter: int = 0
    """Qₐ: of Q, the partition elements of PEFT adapters a ZeRO-3 run keeps in fp32 (:func:`adapters_kept_fp32`)."""
    k_adapter: int = 0
    """Kₐ: of K, the persistent elements of those adapters."""

    def __post_init__(self) -> None:
        for name, full in (("trainable", self.psi), ("q_trainable", self.q), ("largest_module_grad",
                                                                              self.largest_module)):
            if getattr(self, name) < 0:
                object.__setattr__(self, name, full)

    @property
    def full(self) -> bool:
        """Every parameter trains (the symbols print as Ψ, Q, LL)."""
        return self.trainable == self.psi

    @property
    def psi_tr(self) -> str:
        """The symbol of the trainable count: Ψ in a full fine-tune, Ψtr otherwise."""
        return "Ψ" if self.full else "Ψtr"

    @property
    def q_tr(self) -> str:
        return "Q" if self.full else "Qtr"

    @property
    def frozen(self) -> int:
        """Ψ − Ψtr: elements that do not train."""
        return self.psi - self.trainable


def _sizes(*, model: TransformerModel, candidate: Candidate, hardware: HardwareSpec, training: TrainingSpec,
           settings: ZeroSettings) -> _Sizes:
    psi = parameter_count(model)
    trainable = trainable_count(model)
    n = hardware.world_size
    flat = zero12_partition(model, ranks=n)  # Ψ₁₂, P, Σ: one count of the flat buffer
    largest_tensor = largest_tensor_parameters(model, trainable_only=True)
    q = zero3_partition_elements(model, ranks=n)
    q_trainable = zero3_partition_elements(model, ranks=n, trainable_only=True)
    four_bit = four_bit_weights(model)
    fp32 = adapters_kept_fp32(model=model, candidate=candidate, training=training)
    adapters = [t.numel for t in parameter_tensors(model) if t.adapter] if fp32 else []
    return _Sizes(
        psi=psi, trainable=trainable, n=n, g=candidate.precision.bytes_per_element, padded=flat.padded, p=flat.per_rank,
        sigma=flat.held, piece=flat.largest_piece, q=q, q_trainable=q_trainable,
        s=min(q_trainable, settings.sub_group_size),
        k=persistent_parameters(model, threshold=settings.param_persistence_threshold),
        largest_tensor=largest_tensor, largest_module=largest_layer_parameters(model),
        largest_module_grad=largest_layer_parameters(model, trainable_only=True),
        tied=tied_copy_elements(model), bucket=settings.reduce_bucket_elements,
        gas=gradient_accumulation_steps(candidate=candidate, hardware=hardware, training=training),
        four_bit=four_bit.elements, four_bit_bytes=four_bit.held_bytes,
        four_bit_statistics=four_bit.statistics_bytes,
        q_adapter=sum(-(-numel // n) for numel in adapters),
        k_adapter=sum(numel for numel in adapters if numel <= settings.param_persistence_threshold),
    )


def _place(device: OffloadDevice) -> Location:
    return {OffloadDevice.NONE: Location.GPU, OffloadDevice.CPU: Location.HOST, OffloadDevice.NVME: Location.NVME}[
        device
    ]


def _item(name: str, category: Category, location: Location, num_bytes: int, formula: str, source: str,
          phase: Phase = Phase.ALWAYS) -> LedgerItem:
    return LedgerItem(name=name, category=category, location=location, bytes=num_bytes, formula=formula,
                      source=source, phase=phase)
