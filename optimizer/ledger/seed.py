"""Seed-mode ledger items: the seed document's own accounting, reproduced exactly (pure).

Source: the seed document the project grew from (Q130 · 显存优化技术, a worked ledger in Chinese; its figures
are in docs/ledger.md, "Seed mode"). Its rules, for Ψ parameters on N ranks:

* FP32 parameters 4Ψ, FP32 gradients 4Ψ, Adam's two FP32 states 8Ψ; *no* extra FP32 master
  copy ("本例未额外算 FP32 主权重"); activations and working buffers are stated numbers.
* ZeRO partitions ideally over N: stage 1 the optimizer states, stage 2 also the gradients,
  stage 3 also the parameters (the seed's ZeRO table: 26 / 22 / 20 / 18 GB per card).
* Checkpointing swaps the activation figure for the stated one (8 → 3 GB: 21 GB per card;
  with stage 2, 15 GB).
* Offload moves the rank's share of the optimizer states to the host (stage 1 + CPU offload:
  18 GB on the GPU, each rank's 4 GB on the host).

Where the seed only teaches arithmetic — its "22 GB with AMP" halves the activations alone —
seed mode follows real mixed-precision accounting instead (ZeRO paper, §3: 2Ψ 16-bit
parameters, 2Ψ 16-bit gradients, and 4Ψ FP32 master weights beside the 8Ψ Adam states), and
scales the stated FP32 activations to 16-bit elements.
"""

from __future__ import annotations

from optimizer.ledger.items import Category, LedgerItem, Location, Phase
from optimizer.study.knobs import Candidate, OffloadDevice, Precision, ZeroStage
from optimizer.study.specs import HardwareSpec, SeedModel, TrainingSpec

SEED = "seed document (Q130), table '先把单卡 26 GB 的账算出来'"
ZERO_PAPER = "ZeRO (Rajbhandari et al. 2020) §3, mixed-precision Adam 16Ψ"
FP32_STATE_BYTES = 4
"""One FP32 element."""


def _share(total: int, ranks: int, partitioned: bool) -> tuple[int, str]:
    """Bytes one rank holds of ``total``, and the divisor's spelling for the formula."""
    return (total // ranks, "/N") if partitioned else (total, "")


def _place(device: OffloadDevice) -> Location:
    return {OffloadDevice.NONE: Location.GPU, OffloadDevice.CPU: Location.HOST, OffloadDevice.NVME: Location.NVME}[
        device
    ]


def seed_items(
    *, candidate: Candidate, model: SeedModel, hardware: HardwareSpec, training: TrainingSpec
) -> list[LedgerItem]:
    """The seed's per-rank items for ``candidate`` (valid, as checked by the caller)."""
    psi, n = model.parameters, hardware.world_size
    stage = candidate.zero_stage
    mixed = candidate.precision is not Precision.FP32
    lp = candidate.precision.bytes_per_element
    source_states = ZERO_PAPER if mixed else SEED
    items: list[LedgerItem] = []

    params, div = _share(lp * psi, n, stage >= ZeroStage.PARAMETERS)
    items.append(LedgerItem(
        name=f"{candidate.precision} parameters", category=Category.PARAMS,
        location=_place(candidate.offload_param), bytes=params, formula=f"{lp}Ψ{div}", source=source_states))

    grads, div = _share(lp * psi, n, stage >= ZeroStage.GRADIENTS)
    items.append(LedgerItem(
        name=f"{candidate.precision} gradients", category=Category.GRADS, location=Location.GPU,
        bytes=grads, formula=f"{lp}Ψ{div}", source=source_states))

    state_place = _place(candidate.offload_optimizer)
    partition_states = stage >= ZeroStage.OPTIMIZER
    adam = FP32_STATE_BYTES * training.optimizer.states_per_param * psi
    states, div = _share(adam, n, partition_states)
    items.append(LedgerItem(
        name="Adam exp_avg + exp_avg_sq (fp32)", category=Category.OPTIMIZER, location=state_place,
        bytes=states, formula=f"8Ψ{div}", source=source_states))
    if mixed:
        master, div = _share(FP32_STATE_BYTES * psi, n, partition_states)
        items.append(LedgerItem(
            name="fp32 master weights", category=Category.MASTER_WEIGHTS, location=state_place,
            bytes=master, formula=f"4Ψ{div}", source=ZERO_PAPER))

    stated = model.activation_bytes_for(candidate.checkpointing)
    if stated is None:  # guarded by constraints.invalid_reasons
        raise ValueError(f"no activation figure for checkpointing={candidate.checkpointing}")
    stated_lp = model.activation_precision.bytes_per_element
    scaled = stated * candidate.micro_batch_size * lp // (training.micro_batch_size * stated_lp)
    formula = f"stated[{candidate.checkpointing}]"
    if candidate.micro_batch_size != training.micro_batch_size:
        formula += f" × {candidate.micro_batch_size}/{training.micro_batch_size} (micro-batch)"
    if lp != model.activation_precision.bytes_per_element:
        formula += f" × {lp}/{model.activation_precision.bytes_per_element} (element bytes)"
    items.append(LedgerItem(
        name=f"activations ({candidate.checkpointing})", category=Category.ACTIVATIONS, location=Location.GPU,
        bytes=scaled, formula=formula,
        source=f"study: the stated figure ({SEED}); linear in b (Korthikanti et al. 2022 §4.1)",
        phase=Phase.BACKWARD))
    items.append(LedgerItem(
        name="working buffers (stated)", category=Category.BUFFERS, location=Location.GPU,
        bytes=model.buffer_bytes, formula="stated", source=SEED))
    return items
