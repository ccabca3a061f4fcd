"""What the probe times for a study, and what the time model reads from it (pure).

:func:`probe_plan` derives, from the study alone, the operations its candidates run at their own shapes — so a
probe answers for *this* model on *this* machine, not for a datasheet's ideal GEMM:

* **GEMMs**: each distinct weight shape of the model — per block Q and O (h×h), K and V (h×kv·d), the MLP's
  h×f and f×h (GELU: one up projection; SwiGLU: gate and up), ``layers`` times, and the LM head h×V — as a
  micro-batch of T = rows·s tokens runs it: forward X·Wᵀ, the input gradient dY·W and the weight gradient
  dYᵀ·X (the three GEMMs of ``torch.nn.functional.linear``'s autograd), in each precision of the search space
  (and the hardware's) at each micro-batch size of the space. Counted as the time model counts them: 2 FLOPs per
  weight element and token for each of the three (:mod:`optimizer.perf.throughput`, **compute**).
* **attention**: the core, softmax(QKᵀ/√d)·V with its backward, at (micro-batch, heads, s, d), as the model runs
  it (eager: two matmuls and a softmax; fused: ``scaled_dot_product_attention``) — counted, as the
  time model does, as 2·s·h FLOPs per token and layer forward and twice that backward.
* **optimizer steps**: Adam on the device over Ψtr parameters, DeepSpeedCPUAdam on the host over one rank's
  partition Ψtr/W where the space offloads the optimizer (both capped at :data:`MAX_ELEMENTS`).
* **copies**: host↔device where the space offloads (pinned and pageable; on CPU ranks host memory to host memory),
  device-memory bandwidth where the model has a 4-bit base (its dequantization, :mod:`optimizer.perf.four_bit_work`).
* **collectives** across the node's ranks: all-reduce and reduce-scatter at the gradient bucket
  (``reduce_bucket_size``, :mod:`optimizer.deepspeed.zero_settings`), all-gather at the ZeRO-1/2 gather bucket and
  at ZeRO-3's prefetch bucket (one of the two where they are within 2×), the all-reduce and all-gather also at
  :data:`WIDE_BYTES` (CPU ranks: :data:`WIDE_BYTES_CPU`): the time model's seconds per byte is the slope between
  the two (:func:`collective_beta`), since how many calls a stage makes — one all-reduce of every gradient at
  ZeRO-0, one per bucket at ZeRO-1/2, one per module at ZeRO-3 — is not in its byte count, and a bucket-sized call
  on CPU ranks is mostly its latency (gloo: ~1 ms for 8 kB, which priced per byte would make ZeRO-0's one
  all-reduce 20× too slow).
* **NVMe**: write and read at ``hardware.nvme_path`` where the space offloads to NVMe.
* **the model's own pass**: its forward and backward with autograd alone, at most :data:`PASS_LAYERS` blocks deep at its
  own width, in each precision at each micro-batch and once on one row of a few tokens
  (:mod:`optimizer.perf.model_pass`): the per-token work the FLOPs above leave out (norms, activations, adapters).
* **DeepSpeed's engine**: one micro-step that accumulates and one that steps the optimizer, at each ZeRO stage of the
  space, in the space's other precisions at ZeRO-0 and its lowest sharded stage (:attr:`ProbePlan.engine_others`,
  :attr:`ProbePlan.engine_other_stages`), on the study's model at a tiny width
  (:mod:`optimizer.perf.skeleton`): DeepSpeed's own cost per micro-step and per optimizer step — hooks, buckets, each
  collective call's latency — which the FLOPs and bytes above leave out.

:func:`optimizer.perf.probed_rates.probed_rates` turns the probe into the time model's seconds per unit
(:class:`~optimizer.perf.rates.Rates`) with the per-micro-batch shape of the compute rate
(:attr:`Rates.flop_factors`): the machine's kernels are not linear in FLOPs (a CPU's bf16 GEMM runs 2.3× faster per
FLOP at micro-batch 4 than at 1; fp32 1.04×).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optimizer.deepspeed.zero_settings import zero_settings
from optimizer.ledger.transformer import four_bit_weights, trainable_count
from optimizer.perf.skeleton import skeleton_model
from optimizer.study.knobs import EveryKCheckpointing, FullCheckpointing, OffloadDevice, Precision, ZeroStage
from optimizer.study.machine_probe import MachineProbe
from optimizer.study.specs import Accelerator, AttentionKind, MlpKind, TransformerModel, baseline_candidate
from optimizer.study.study_file import StudySpec

MAX_ELEMENTS = 1 << 24
"""Largest buffer a probe allocates (elements): 64 MB in fp32 — a rate, not a capacity, is measured."""
MAX_ELEMENTS_CPU = 1 << 22
"""The same on CPU ranks, which share the host with everything else."""
NVME_PROBE_BYTES = 64 << 20
"""Bytes written to and read from the NVMe folder."""
PASS_LAYERS = 2
"""Most blocks of the model's timed pass (:mod:`optimizer.perf.model_pass`)."""
WIDE_BYTES = 16 << 20
"""A collective wide enough that its time is mostly bandwidth: with the bucket-sized one it separates the latency α
of a call from the seconds per byte β (Hockney's t = α + n·β; :func:`collective_beta`)."""
WIDE_BYTES_CPU = 4 << 20
"""The same on CPU ranks, where 4 MB is already mostly bandwidth (gloo on this project's 2-core Xeon, 2 ranks: an
8 kB all-reduce ~0.6 ms, 16 MB ~13 ms, 0.8–1.3 GB/s) and nearer the gradients such a study moves (a CPU study's
model has a few MB of them); each wide call costs a CPU probe 4× less (the three: ~0.3 → ~0.1 s)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbePlan:
    """What one probe times (module doc); JSON for the ranks by :meth:`to_json`."""

    accelerator: str
    """``cuda`` or ``cpu``."""
    ranks: int
    """Ranks per node: all of them time at once, as they train."""
    gemm_shapes: tuple[tuple[int, int, int], ...]
    """(in features, out features, how many such weights the model has)."""
    attention: tuple[int, int, int, int]
    """(heads, kv heads, head dim, layers)."""
    eager_attention: bool
    """The model materialises the scores (``model.attention: eager``: matmul, softmax, matmul) rather than calling a
    fused kernel (``scaled_dot_product_attention``)."""
    sequence_length: int
    """s."""
    rows_per_sample: int
    """Sequences per sample (DPO: 2)."""
    precisions: tuple[str, ...]
    """Precisions the space trains in (and the hardware supports)."""
    micro_batches: tuple[int, ...]
    """Micro-batch sizes of the space."""
    device_adam_elements: int
    """Parameters of the device Adam step timed (0: not timed)."""
    host_adam_elements: int
    """Parameters of DeepSpeedCPUAdam's step timed (0: the space does not offload the optimizer)."""
    copy_bytes: int
    """Bytes of a host↔device copy timed (0: the space offloads nothing)."""
    memory_bytes: int
    """Bytes of a device-memory copy timed (0: no 4-bit base)."""
    reduce_bytes: tuple[int, ...]
    """Bytes of each all-reduce timed: the gradient bucket and :data:`WIDE_BYTES` (CPU ranks:
    :data:`WIDE_BYTES_CPU`; empty: one rank)."""
    scatter_bytes: tuple[int, ...]
    """Bytes of each reduce-scatter timed: the gradient bucket (no wide one: the time model prices no
    reduce-scatter per byte, the all-reduce's slope stands for ZeRO 0–2's reduction; empty: one rank)."""
    gather_bytes: tuple[int, ...]
    """Bytes of each all-gather timed: ZeRO-1/2's bucket and ZeRO-3's prefetch bucket — one of the two where they
    are within 2× of each other (:func:`distinct_sizes`) — and :data:`WIDE_BYTES` (CPU ranks:
    :data:`WIDE_BYTES_CPU`; empty: one rank)."""
    nvme_path: str | None
    """Folder of the NVMe reads and writes (None: the space does not offload to NVMe)."""
    nvme_bytes: int
    """Bytes written and read there."""
    engine_stages: tuple[int, ...] = ()
    """ZeRO stages whose engine is timed on the skeleton (empty: none, :attr:`engine_skipped` says why)."""
    engine_precision: str = ""
    """The precision the skeleton's engines train in: the space's 16-bit one where it has one (most of its
    candidates), else fp32."""
    engine_others: tuple[str, ...] = ()
    """The space's other precisions, each timed at :attr:`engine_other_stages` too: DeepSpeed wraps the optimizer by
    precision (DeepSpeed 0.19 ``runtime/engine.py`` ``_configure_optimizer``: ZeRO-0 fp32 steps the bare optimizer,
    bf16 its BF16_Optimizer with fp32 gradient accumulation, fp16 the loss-scaled FP16_Optimizer; ZeRO 1–3 keep
    fp32 master weights and cast in 16 bits only), so a stage's cost per micro-step is not one figure for all of them
    (on this project's CPU grids an fp32 ZeRO-1 micro-step costs less than fp32 ZeRO-0's, a bf16 one more)."""

    @property
    def engine_other_stages(self) -> tuple[int, ...]:
        """The stages :attr:`engine_others` are timed at: ZeRO-0 where the space has it (its own optimizer path, the
        bare optimizer or BF16_Optimizer) and the lowest sharded stage of the space (1, else 2, else 3). ZeRO-2 is
        ZeRO-1's optimizer class (``runtime/zero/stage_1_and_2.py``) and ZeRO 1–3 all keep fp32 master weights and
        cast in 16 bits, so a higher stage takes the factor of the nearest sharded one timed below it
        (:func:`optimizer.perf.probed_rates.borrowed_factors`): on the twelve CPU grids, ρ from the probe alone moved
        by at most ±0.01 (reference Llama +0.04) with their fp32 ZeRO-2/3 engines left out, and those two engines
        took ~1.2 s of the demo's 5.8 s probe."""
        sharded = [s for s in self.engine_stages if s >= 1]
        return tuple(s for s in self.engine_stages if s == 0) + tuple(sharded[:1])
    engine_recompute: bool = False
    """The space recomputes whole blocks (``checkpointing: full`` or ``every_K``): the engine of the lowest stage is
    also timed with every block checkpointed (``torch.utils.checkpoint``'s own cost per micro-step: on CPU ranks
    ~15 ms for 2 tiny blocks, far more than the recomputed FLOPs)."""
    engine_skipped: str = ""
    """Why no engine is timed (the model cannot be shrunk, :func:`optimizer.perf.skeleton.skeleton_model`)."""
    pass_layers: int = 0
    """Blocks of the model's own pass timed at each precision and micro-batch (:mod:`optimizer.perf.model_pass`;
    0: none, a model built by the study's own code)."""

    def gemm_flops(self, micro_batch: int) -> float:
        """FLOPs of the GEMMs of one micro-step's forward + backward, as the time model counts them (module doc)."""
        tokens = micro_batch * self.rows_per_sample * self.sequence_length
        return float(sum(3 * 2 * fan_in * fan_out * count for fan_in, fan_out, count in self.gemm_shapes) * tokens)

    def attention_flops(self, micro_batch: int) -> float:
        """FLOPs of the attention cores' forward + backward of one micro-step, as the time model counts them:
        3 × 2·L·s·h per token (:mod:`optimizer.perf.throughput`, **compute**)."""
        heads, _, head_dim, layers = self.attention
        tokens = micro_batch * self.rows_per_sample * self.sequence_length
        return float(3 * 2 * layers * self.sequence_length * heads * head_dim * tokens)

    def to_json(self) -> dict[str, Any]:
        return {"accelerator": self.accelerator, "ranks": self.ranks,
                "gemm_shapes": [list(s) for s in self.gemm_shapes], "attention": list(self.attention),
                "eager_attention": self.eager_attention,
                "sequence_length": self.sequence_length,
                "rows_per_sample": self.rows_per_sample, "precisions": list(self.precisions),
                "micro_batches": list(self.micro_batches), "device_adam_elements": self.device_adam_elements,
                "host_adam_elements": self.host_adam_elements, "copy_bytes": self.copy_bytes,
                "memory_bytes": self.memory_bytes, "reduce_bytes": list(self.reduce_bytes),
                "scatter_bytes": list(self.scatter_bytes), "gather_bytes": list(self.gather_bytes),
                "nvme_path": self.nvme_path, "nvme_bytes": self.nvme_bytes,
                "engine_stages": list(self.engine_stages), "engine_precision": self.engine_precision,
                "engine_others": list(self.engine_others), "engine_other_stages": list(self.engine_other_stages),
                "engine_skipped": self.engine_skipped, "engine_recompute": self.engine_recompute,
                "pass_layers": self.pass_layers,
                "gemm_flops": {str(b): self.gemm_flops(b) for b in self.micro_batches},
                "attention_flops": {str(b): self.attention_flops(b) for b in self.micro_batches}}


def gemm_shapes(model: TransformerModel) -> tuple[tuple[int, int, int], ...]:
    """The model's weight shapes as (in, out, count): per block Q, O (h→h), K, V (h→kv·d), the MLP (GELU h→f, f→h;
    SwiGLU two h→f and f→h), and the LM head h→V (tied or not, it is one GEMM per token)."""
    h, f, L = model.hidden_size, model.ffn_size, model.layers
    kv = model.kv_heads * model.head_dim
    counts: dict[tuple[int, int], int] = {}
    up = 2 if model.mlp is MlpKind.SWIGLU else 1
    for shape, n in (((h, h), 2), ((h, kv), 2), ((h, f), up), ((f, h), 1)):
        counts[shape] = counts.get(shape, 0) + n * L
    counts[(h, model.vocab_size)] = counts.get((h, model.vocab_size), 0) + 1
    return tuple((fan_in, fan_out, n) for (fan_in, fan_out), n in counts.items())


def distinct_sizes(sizes: list[int]) -> tuple[int, ...]:
    """``sizes`` ascending, the smallest and the widest always, each between them dropped that is within 2× of the
    last one kept (7,372 and 8,192 B: ZeRO-3's prefetch bucket and ZeRO-1/2's gather bucket of a small model): a
    collective's time is α + n·β, and a call that close to another tells the slope nothing the smallest and the
    widest do not (:func:`collective_beta` reads those two)."""
    ordered = sorted(set(sizes))
    kept: list[int] = ordered[:1]
    for size in ordered[1:-1]:
        if size > 2 * kept[-1]:
            kept.append(size)
    return tuple(kept + ordered[-1:] if len(ordered) > 1 else kept)


def probe_plan(spec: StudySpec) -> ProbePlan:
    """What a probe of ``spec``'s machine times (module doc)."""
    model, hardware = spec.model, spec.hardware
    assert isinstance(model, TransformerModel)
    base = spec.training
    candidates = list(spec.search_space.candidates(baseline_candidate(base)))
    precisions = tuple(p.value for p in Precision if p in hardware.supported_precisions
                       and any(c.precision is p for c in candidates))
    micro_batches = tuple(sorted({c.micro_batch_size for c in candidates}))
    cpu = hardware.accelerator is Accelerator.CPU
    cap = MAX_ELEMENTS_CPU if cpu else MAX_ELEMENTS
    trainable = trainable_count(model)
    ranks = hardware.gpus_per_node
    b = 2 if any(p != Precision.FP32.value for p in precisions) else 4
    offload_opt = any(c.offload_optimizer is not OffloadDevice.NONE for c in candidates)
    offload_any = offload_opt or any(c.offload_param is not OffloadDevice.NONE for c in candidates)
    nvme = any(OffloadDevice.NVME in (c.offload_optimizer, c.offload_param) for c in candidates)
    stages = {c.zero_stage for c in candidates}
    gather: list[int] = []
    reduce_bytes: tuple[int, ...] = ()
    scatter_bytes: tuple[int, ...] = ()
    wide = WIDE_BYTES_CPU if cpu else WIDE_BYTES
    if hardware.world_size > 1:
        settings = zero_settings(model=model, stage=ZeroStage.GRADIENTS)
        bucket = min(settings.reduce_bucket_elements, trainable, cap) * b
        reduce_bytes, scatter_bytes = distinct_sizes([bucket, wide]), (bucket,)
        if stages & {ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS}:
            gather.append(min(settings.allgather_bucket_elements, trainable, cap) * b)
        if ZeroStage.PARAMETERS in stages:
            gather.append(min(zero_settings(model=model, stage=ZeroStage.PARAMETERS).prefetch_bucket_elements,
                              cap) * b)
        if gather:  # the stages that gather: a wide one too (β)
            gather.append(wide)
    four_bit = four_bit_weights(model).elements > 0
    skeleton = skeleton_model(model)
    half = [p for p in precisions if p != Precision.FP32.value]
    return ProbePlan(
        accelerator=hardware.accelerator.value, ranks=ranks, gemm_shapes=gemm_shapes(model),
        attention=(model.heads, model.kv_heads, model.head_dim, model.layers),
        eager_attention=model.attention is AttentionKind.EAGER, sequence_length=base.sequence_length,
        rows_per_sample=model.rows(1), precisions=precisions, micro_batches=micro_batches,
        device_adam_elements=min(trainable, cap), host_adam_elements=min(-(-trainable // hardware.world_size), cap)
        if offload_opt else 0,
        copy_bytes=min(-(-trainable // hardware.world_size), cap) * b if offload_any else 0,
        memory_bytes=cap * 2 if four_bit else 0, reduce_bytes=reduce_bytes, scatter_bytes=scatter_bytes,
        gather_bytes=distinct_sizes(gather),
        nvme_path=hardware.nvme_path if nvme else None, nvme_bytes=NVME_PROBE_BYTES if nvme else 0,
        engine_stages=() if isinstance(skeleton, str) else tuple(sorted(int(s) for s in stages)),
        engine_precision=(main := (half or list(precisions) or [Precision.FP32.value])[0]),
        engine_others=() if isinstance(skeleton, str) else tuple(p for p in precisions if p != main),
        engine_skipped=skeleton if isinstance(skeleton, str) else "",
        engine_recompute=any(isinstance(c.checkpointing, (FullCheckpointing, EveryKCheckpointing)) for c in candidates),
        pass_layers=0 if model.entry_point is not None else min(model.layers, PASS_LAYERS))


def compute_rate(probe: MachineProbe, *, precision: str, micro_batch: int) -> float | None:
    """Seconds per FLOP (as the time model counts them) of the GEMMs and attention at ``precision`` and
    ``micro_batch``; None when the probe lacks either."""
    gemm = probe.find("gemm", precision=precision, micro_batch=micro_batch)
    attention = probe.find("attention", precision=precision, micro_batch=micro_batch)
    if gemm is None or attention is None:
        return None
    return (gemm.median_s + attention.median_s) / (gemm.work + attention.work)


def collective_beta(probe: MachineProbe, kind: str) -> float | None:
    """Seconds per byte of a ``kind`` collective's buffer: the slope (t₂ − t₁) / (n₂ − n₁) between its smallest and
    its widest timing (Hockney's α + n·β; Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective
    Communication Operations in MPICH", §2), else the one timing's seconds per byte; None without a timing. A slope
    the spread makes non-positive falls back to the widest call's seconds per byte (an upper bound of β)."""
    figures = sorted(probe.of_kind(kind), key=lambda f: f.work)
    if not figures:
        return None
    small, wide = figures[0], figures[-1]
    if wide.work > small.work and wide.median_s > small.median_s:
        return (wide.median_s - small.median_s) / (wide.work - small.work)
    return wide.seconds_per_unit
