"""Throughput model: time of one optimizer step per rank, itemised, and tokens/s (pure).

The step is split into *work* (what the candidate makes the hardware do) and *rates* (how fast the
hardware does it), so that calibration (:mod:`optimizer.perf.calibration`) can refit the rates from measured
trials without touching the work. Per optimizer step and rank, with Ψ parameters, W data-parallel ranks,
G = global batch, s sequence length, T = G·n·s/W tokens per rank (n = 1 unless each sample runs n rows, below),
M = G/(micro-batch·W) micro-steps:

* **compute** — forward FLOPs per token F = 2·N + 2·L·s·h (Kaplan et al. 2020, "Scaling Laws for Neural
  Language Models", Table 1: N non-embedding parameters, plus the attention scores; the LM head's 2·V·h
  is added since it is a matmul); training = 3·F·T (backward ≈ 2× forward). Recomputation adds the
  forward of the recomputed blocks: all of them (``full``), every k-th (``every_k``), or the attention
  scores 2·L·s·h per token (``selective``). Time = FLOPs / (peak FLOP/s × efficiency).
  A model that trains in part (PEFT adapters, ``training.frozen``; :class:`BackwardShare`) splits the backward
  into its two GEMMs per weight: the input gradient (2 FLOPs per weight element and token, and the attention
  scores' 2·L·s·h, from the top of the model down to its lowest trainable tensor — autograd computes no
  gradient below it) and the weight gradient (2 per *trainable* weight element only: ``torch.nn.functional
  .linear``'s backward skips ``grad_weight`` when ``needs_input_grad[1]`` is false). A full fine-tune gives
  2·F again. The adapters' own GEMMs (2·r·(fan_in + fan_out) per token each) are in the forward through Ψ,
  which counts their parameters.
* **communication** — ring collectives move (W−1)/W of the buffer per rank; grads and 16-bit params travel
  in the training dtype (b = 2 bytes for bf16/fp16, 4 for fp32). ZeRO paper §7 (Rajbhandari et al. 2020):
  plain data parallel and ZeRO-1/2 move 2Ψ per step (all-reduce = reduce-scatter + all-gather), ZeRO-3
  3Ψ (parameters gathered in forward and again in backward, gradients reduce-scattered). Only trainable
  tensors have gradients to reduce and, at ZeRO-1/2, a flat group to gather (``stage_1_and_2.py:428-434``;
  stage 0 reduces the parameters with a ``.grad``, ``engine.py:3073-3095``): 2Ψtr; ZeRO-3 gathers every
  tensor, frozen ones too, in forward and backward and reduce-scatters the trainable ones: 2Ψ + Ψtr. DeepSpeed
  reduces ZeRO-2 gradients every micro-step and ZeRO-3 gathers/reduces every micro-step, so with
  gradient accumulation those volumes repeat M times. ZeRO-3 has ``overlap_comm`` and prefetching on
  (dsopt's builder): its communication is counted as hidden under compute up to the compute time.
* **offload** — optimizer on the CPU: 16-bit (or fp32) gradients of the rank's partition go to the host and
  updated parameters come back over PCIe each step (2·Ψtr/W·b bytes), and DeepSpeedCPUAdam updates Ψtr/W
  parameters on the host (the optimizer holds the trainable partition only). Parameters on the CPU (ZeRO-3):
  the partition crosses PCIe in forward and backward of every micro-step (2·M·Ψ/W·b, frozen partitions too).
  NVMe adds the optimizer states' swap (12 bytes per trainable parameter read and written) at the NVMe
  bandwidth, which is unknown unless calibrated.
* **QLoRA** — a 4-bit base's matmuls run at ``bnb_4bit_compute_dtype``'s rate (fp32 compute under a bf16
  candidate: its forward, input-gradient and recomputed GEMMs at the fp32 peak), each weight is dequantized for every
  matmul (device-memory traffic at the HBM rate, :mod:`optimizer.perf.four_bit_work`), and ZeRO-3 gathers and
  parameter offload move the packed bytes, not 16-bit weights.
* **rows and the reference** — ``training.sequences_per_sample`` rows run per sample (a DPO pair's chosen and
  rejected completions, stacked into one batch: ``trl/trainer/dpo_trainer.py:349-352``), so T counts G·n·s/W
  tokens; ``training.reference_model`` adds one forward of the reference per micro-step on the same rows
  (``dpo_trainer.py:1319-1336``, under ``no_grad``: F·T more FLOPs, one more dequantization of a 4-bit base, and at
  ZeRO-3 one more gather of the held parameters, Ψ·b·(W−1)/W per micro-step, and their PCIe crossing where they
  are offloaded — the copy TRL partitions like the policy, or the policy itself with its adapters disabled).
* **overhead** — DeepSpeed's own time per micro-step at each ZeRO stage (hooks, bucketing, each collective call's
  latency), plus per optimizer step (:attr:`optimizer.perf.rates.Rates.step_shares`). The probe times it on the
  study's model at a tiny width (:mod:`optimizer.perf.skeleton`); without a probe it is 0 on GPUs before
  calibration and unknown on CPU ranks, where it dominates small models.

Figures come from :mod:`optimizer.study.hardware_profiles`, or where the study carries one from this machine's probe
(:func:`optimizer.perf.probed_rates.probed_rates`); a missing one makes the prediction ``None`` with the reason,
never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimizer.ledger.transformer import parameter_count, trainable_count
from optimizer.perf.four_bit_work import four_bit_work
from optimizer.perf.probed_rates import probed_rates
from optimizer.perf.rates import FEATURES, Rates, Work
from optimizer.study.constraints import gradient_accumulation_steps
from optimizer.study.knobs import (
    Candidate,
    EveryKCheckpointing,
    FullCheckpointing,
    OffloadDevice,
    Precision,
    SelectiveCheckpointing,
    ZeroStage,
)
from optimizer.study.specs import HardwareSpec, TrainingSpec, TransformerModel


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    """A predicted optimizer step of one rank."""

    terms_s: tuple[tuple[str, float], ...]
    """Seconds per term: compute, communication, offload, host_optimizer, nvme, overhead."""
    total_s: float
    """The step (exposed time)."""
    tokens_per_s: float
    """Throughput of the whole job: tokens per step over all ranks / step time."""
    source: str
    """Where the rates came from."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BackwardShare:
    """What of the backward a model that trains in part computes (module doc, **compute**); from its inventory."""

    trainable_blocks: int
    """Trainable elements outside the embeddings and the LM head (adapters, unfrozen layers): their weight
    gradients."""
    head_trains: bool
    """The LM head's weight (the embedding's, when tied) trains: its weight gradient is computed."""
    frozen_prefix: int
    """Block elements before the first trainable tensor in the model's order: no input gradient flows there."""
    below_head: bool
    """Something under the LM head trains, so the head's input gradient is computed."""


def backward_share(model: TransformerModel) -> BackwardShare | None:
    """The :class:`BackwardShare` of ``model``, or None when every parameter trains (no inventory, or all of it
    trainable). Embeddings are the inventory's ``*Embedding`` modules; the LM head is the non-embedding tensor
    of shape (V, h) — its name differs between families, its shape does not."""
    inventory = model.inventory
    if inventory is None or inventory.trainable_parameters == inventory.parameters:
        return None
    V, h = model.vocab_size, model.hidden_size
    trainable_blocks = prefix = 0
    head_trains = below_head = seen_trainable = False
    for tensor in inventory.tensors:
        embedding = "Embedding" in tensor.module_type
        head = not embedding and tensor.shape == (V, h)
        if head:
            head_trains = head_trains or tensor.trainable
            continue
        if tensor.trainable:
            seen_trainable = below_head = True
            if embedding and model.tied_embeddings and tensor.shape == (V, h):
                head_trains = True
        if embedding:
            continue
        if tensor.trainable:
            trainable_blocks += tensor.numel
        elif not seen_trainable:
            prefix += tensor.numel
    return BackwardShare(trainable_blocks=trainable_blocks, head_trains=head_trains, frozen_prefix=prefix,
                         below_head=below_head)


def work(*, candidate: Candidate, model: TransformerModel, hardware: HardwareSpec, training: TrainingSpec) -> Work:
    """The work of one optimizer step per rank for ``candidate`` (module doc for each formula)."""
    ranks = hardware.world_size
    micro = gradient_accumulation_steps(candidate=candidate, hardware=hardware, training=training)
    tokens = model.rows(training.global_batch_size) * training.sequence_length // ranks
    reference = 1 if model.reference_model else 0  # its forward per micro-step (module doc)
    L, h, s, V = model.layers, model.hidden_size, training.sequence_length, model.vocab_size
    psi, psi_tr = parameter_count(model), trainable_count(model)
    embedding = V * h + (model.max_positions * h if model.position_embedding.value == "learned" else 0)
    head = 0 if model.tied_embeddings else V * h
    blocks = psi - embedding - head
    attention = 2 * L * s * h
    block_forward = 2 * blocks + attention          # per token
    forward = block_forward + 2 * V * h             # + LM head matmul
    share = backward_share(model)
    if share is None:  # every parameter trains
        backward = 2 * forward
    else:
        above = 1.0 - share.frozen_prefix / blocks if blocks else 1.0
        backward = (above * (2 * blocks + 2 * attention) + (2 * V * h if share.below_head else 0)
                    + 2 * share.trainable_blocks + (2 * V * h if share.head_trains else 0))
    ckpt = candidate.checkpointing
    if isinstance(ckpt, FullCheckpointing):
        recompute = block_forward
    elif isinstance(ckpt, EveryKCheckpointing):
        recompute = block_forward * (L // ckpt.k) / L
    elif isinstance(ckpt, SelectiveCheckpointing):
        recompute = attention
    else:
        recompute = 0
    flops = float(tokens * (forward + backward + recompute + reference * forward))
    b = 4 if candidate.precision is Precision.FP32 else 2
    recomputed_blocks = (1.0 if isinstance(ckpt, FullCheckpointing) else (L // ckpt.k) / L
                         if isinstance(ckpt, EveryKCheckpointing) else 0.0)  # selective recomputes no weight GEMM
    four_bit = four_bit_work(model=model, training_bytes=b, tokens=tokens, micro_steps=micro,
                             recomputed=recomputed_blocks + reference)  # the reference's forward: one more
    other_flops = min(four_bit.other_precision_flops, flops)
    flops -= other_flops
    held = psi * b - four_bit.elements * b + four_bit.packed_bytes  # what ZeRO-3 gathers and offloads (bytes)
    ring = (ranks - 1) / ranks
    stage = candidate.zero_stage
    comm = comm_z3 = 0.0
    if stage in (ZeroStage.DISABLED, ZeroStage.OPTIMIZER):
        comm = 2 * ring * psi_tr * b
    elif stage is ZeroStage.GRADIENTS:
        comm = ring * psi_tr * b * (micro + 1)
    else:
        comm_z3 = ring * ((2 + reference) * held + psi_tr * b) * micro
    partition, trained = held / ranks, psi_tr / ranks
    pcie = host = nvme = 0.0
    if candidate.offload_optimizer is not OffloadDevice.NONE:
        pcie += 2 * trained * b
        host = trained
        if candidate.offload_optimizer is OffloadDevice.NVME:
            nvme += 2 * 12 * trained
    if candidate.offload_param is not OffloadDevice.NONE:
        pcie += (2 + reference) * micro * partition
        if candidate.offload_param is OffloadDevice.NVME:
            nvme += (2 + reference) * micro * partition
    fp32 = candidate.precision is Precision.FP32
    return Work(flops=flops, comm_bytes=comm, comm_bytes_z3=comm_z3, pcie_bytes=pcie, host_params=host,
                nvme_bytes=nvme, micro_steps=micro, stage=stage, tokens=tokens, precision=candidate.precision,
                flops_fp32_compute=0.0 if fp32 else other_flops, flops_16bit_compute=other_flops if fp32 else 0.0,
                dequant_bytes=four_bit.dequant_bytes, micro_batch_size=candidate.micro_batch_size,
                recomputed_blocks=recomputed_blocks)


def profile_rates(*, hardware: HardwareSpec) -> Rates:
    """Seconds per unit from the hardware's profile (None where it has no figure, or no profile is given).

    The profile is the one the study resolved (:attr:`HardwareSpec.profile`: a built-in one or the study's own
    figures). One rate serves both 16-bit formats: bf16's figure where the study trains in bf16, else fp16's
    (every datasheet in :mod:`optimizer.study.hardware_profiles` prints the same figure for both; a V100 has fp16
    only)."""
    profile = hardware.profile
    if profile is None:
        rates = Rates(seconds_per=(None,) * len(FEATURES), source="no hardware.profile")
        return rates if hardware.probe is None else _probed(rates, hardware=hardware)
    link = profile.link_bytes_per_s if hardware.nodes == 1 else (
        hardware.inter_node_bytes_per_s or profile.inter_node_bytes_per_s)
    nvme = hardware.nvme_bytes_per_s

    def inverse(rate: float | None) -> float | None:
        return 1.0 / rate if rate else None

    half_precision = Precision.BF16 if Precision.BF16 in hardware.supported_precisions else Precision.FP16
    fp32, half = profile.flops(Precision.FP32), profile.flops(half_precision)
    gpu = half is not None
    rates = Rates(seconds_per=(
        inverse(fp32 * profile.efficiency) if fp32 else None,
        inverse(half * profile.efficiency) if half else None,
        inverse(link), inverse(link), inverse(profile.pcie_bytes_per_s), inverse(profile.host_adam_params_per_s),
        inverse(nvme),
        *((0.0 if gpu else None),) * 4,  # per-micro-step overheads: negligible on GPUs for large models
        inverse(profile.memory_bytes_per_s),
    ), source=f"profile {profile.name}")
    return rates if hardware.probe is None else _probed(rates, hardware=hardware)


def _probed(rates: Rates, *, hardware: HardwareSpec) -> Rates:
    assert hardware.probe is not None
    return probed_rates(rates, hardware=hardware, probe=hardware.probe)


def predict(*, job: Work, rates: Rates, ranks: int) -> StepTime | str:
    """The step time for ``job`` at ``rates``, or why it is unknown (the first missing figure it needs)."""
    vector = rates.features(job)
    seconds = []
    for name, amount, per in zip(FEATURES, vector, rates.seconds_per, strict=True):
        if amount and per is None:
            return f"unknown: no figure for {name.replace('_', ' ')} ({rates.source}); calibration or " \
                   "hardware.profile supplies it"
        seconds.append(amount * (per or 0.0))
    compute32, compute16, comm, comm_z3, pcie, host, nvme, *overhead, dequant = seconds
    compute = compute32 + compute16 + dequant
    exposed_z3 = max(0.0, comm_z3 - compute) if rates.overlap_z3 else comm_z3
    terms = (("compute", compute), ("communication", comm + exposed_z3), ("offload", pcie),
             ("host_optimizer", host), ("nvme", nvme), ("overhead", sum(overhead)))
    total = sum(t for _, t in terms)
    if total <= 0:
        return f"unknown: the rates give no time ({rates.source})"
    return StepTime(terms_s=terms, total_s=total, tokens_per_s=job.tokens * ranks / total, source=rates.source)


def predict_candidate(*, candidate: Candidate, model: TransformerModel, hardware: HardwareSpec,
                      training: TrainingSpec, rates: Rates | None = None) -> StepTime | str:
    """:func:`predict` for a candidate, at ``rates`` (default: the hardware profile's)."""
    job = work(candidate=candidate, model=model, hardware=hardware, training=training)
    return predict(job=job, rates=rates or profile_rates(hardware=hardware), ranks=hardware.world_size)
