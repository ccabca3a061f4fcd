"""The throughput model's two halves (:mod:`optimizer.perf.throughput`): the *work* one optimizer step asks of one rank
and the machine's *rates* (seconds per unit of that work), both in :data:`FEATURES` order, so that calibration
(:mod:`optimizer.perf.calibration`) and the probe (:mod:`optimizer.perf.probed_rates`) set the rates without
touching the work (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from optimizer.study.knobs import Precision, ZeroStage

FEATURES = ("flops_fp32", "flops_16bit", "comm_bytes", "comm_bytes_z3", "pcie_bytes", "host_params", "nvme_bytes",
            "micro_steps_z0", "micro_steps_z1", "micro_steps_z2", "micro_steps_z3", "dequant_bytes")
"""The work of one optimizer step per rank, in the order of :class:`Rates`'s seconds-per-unit."""
COMPUTE_FEATURES = ("flops_fp32", "flops_16bit", "dequant_bytes")
"""The features of compute (:mod:`optimizer.perf.throughput`): what a probe's model pass is counted in
(:mod:`optimizer.perf.model_pass`); :attr:`Rates.pass_factors` scales the FLOPs among them (the dequantization runs
once per matmul, whatever the tokens)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Work:
    """What one optimizer step asks of one rank (each a count of the unit in its name)."""

    flops: float
    """Floating-point operations, recomputation included."""
    comm_bytes: float
    """Bytes through collectives, ZeRO 0–2 (not overlapped)."""
    comm_bytes_z3: float
    """Bytes through collectives at ZeRO-3 (overlapped with compute)."""
    pcie_bytes: float
    """Bytes over host↔device links for offload."""
    host_params: float
    """Parameters updated by the CPU optimizer."""
    nvme_bytes: float
    """Bytes swapped to and from NVMe."""
    micro_steps: int
    """Micro-steps (forward + backward) per optimizer step."""
    stage: ZeroStage
    """ZeRO stage (which per-micro-step overhead applies)."""
    tokens: int
    """Tokens this rank processes per optimizer step."""
    precision: Precision
    """Training precision (which peak FLOP/s applies)."""
    flops_fp32_compute: float = 0.0
    """FLOPs of a QLoRA base's 4-bit matmuls run in fp32 (``bnb_4bit_compute_dtype: float32``) by a 16-bit
    candidate; ``flops`` holds the rest."""
    flops_16bit_compute: float = 0.0
    """FLOPs of 4-bit matmuls run in 16 bits by an fp32 candidate."""
    dequant_bytes: float = 0.0
    """Device-memory bytes written and read by dequantizing 4-bit weights (QLoRA; module doc)."""
    micro_batch_size: int = 0
    """Samples per micro-step (which of the probe's per-micro-batch compute rates applies; 0: none)."""
    recomputed_blocks: float = 0.0
    """Share of the blocks recomputed in backward (full checkpointing 1, every_K ⌊L/K⌋/L; selective recomputes no
    block): how much of the probe's recomputation cost per micro-step applies (:attr:`Rates.recompute_shares`)."""

    def vector(self) -> tuple[float, ...]:
        """The work in :data:`FEATURES` order."""
        steps = [0.0, 0.0, 0.0, 0.0]
        steps[int(self.stage)] = float(self.micro_steps)
        fp32 = self.precision is Precision.FP32
        return ((self.flops if fp32 else self.flops_fp32_compute),
                (self.flops_16bit_compute if fp32 else self.flops), self.comm_bytes, self.comm_bytes_z3,
                self.pcie_bytes, self.host_params,
                self.nvme_bytes, *steps, self.dequant_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Rates:
    """Seconds per unit of work, in :data:`FEATURES` order (None: unknown)."""

    seconds_per: tuple[float | None, ...]
    """Seconds per FLOP, per byte communicated, …, per micro-step of each stage."""
    source: str
    """``profile NAME`` or ``calibrated on N trials``."""
    overlap_z3: bool = True
    """ZeRO-3 communication hidden under compute up to the compute time (profile rates); calibrated rates
    are fitted as exposed time already."""
    flop_factors: tuple[tuple[str, int, float], ...] = ()
    """(precision, micro-batch, factor): the machine's seconds per FLOP at that micro-batch relative to the
    figure in ``seconds_per`` (the probe's, :func:`optimizer.perf.probed_rates.probed_rates`); 1 where absent. A
    GEMM's rate depends on its shape, so the FLOP features are scaled by it before the linear model applies —
    in prediction and in calibration alike, which keeps the fit linear."""
    step_shares: tuple[tuple[int, float], ...] = ()
    """(ZeRO stage, share): DeepSpeed's cost of an optimizer step at that stage beyond a micro-step's, in micro-steps
    (the probe's engine, :mod:`optimizer.perf.probed_rates`): the stage's feature counts M + share per optimizer
    step of M micro-steps — ZeRO-1 reduces and gathers once per step, ZeRO-2 reduces every micro-step — so that
    calibration scales the stage's cost without changing its shape."""
    recompute_shares: tuple[tuple[int, float], ...] = ()
    """(ZeRO stage, share): the cost per micro-step of recomputing every block (``torch.utils.checkpoint``'s own
    work beside the recomputed FLOPs: the probe's engine checkpointed less plain, :mod:`optimizer.perf.probed_rates`),
    in units of the stage's micro-step; a candidate's stage feature counts M·share·``recomputed_blocks`` more."""
    engine_factors: tuple[tuple[str, int, float, float], ...] = ()
    """(precision, ZeRO stage, factor, share): the engine of that stage timed in another precision than the figure
    in ``seconds_per`` (DeepSpeed's optimizer wrapper differs by precision, :mod:`optimizer.perf.probe_plan`): its
    micro-step costs ``factor`` of the stage's, its optimizer step ``share`` of its own micro-step more; a candidate
    in that precision counts factor·(M + share) of the stage's micro-steps instead of M + the stage's share."""
    pass_factors: tuple[tuple[str, int, float], ...] = ()
    """(precision, micro-batch, factor): the study's model's whole forward and backward timed at that precision and
    micro-batch against what the other figures price its FLOPs at (the probe's model pass,
    :mod:`optimizer.perf.model_pass`): a candidate in that precision at that micro-batch has its FLOP features (fp32
    and 16-bit) scaled by it — the per-token work no FLOP counts; 1 where absent."""

    def features(self, job: Work) -> tuple[float, ...]:
        """``job``'s work in :data:`FEATURES` order, its FLOPs scaled by :attr:`flop_factors` (per precision of
        the FLOPs: the fp32 feature by fp32's factor, the 16-bit one by the 16-bit precision's) and both by the
        candidate's :attr:`pass_factors`."""
        vector = list(job.vector())
        if self.flop_factors:
            factors = {(p, b): f for p, b, f in self.flop_factors}
            half = next((p for p, _, _ in self.flop_factors if p != Precision.FP32.value), Precision.BF16.value)
            for index, precision in ((0, Precision.FP32.value), (1, half)):
                vector[index] *= factors.get((precision, job.micro_batch_size), 1.0)
        whole = {(p, b): f for p, b, f in self.pass_factors}.get((job.precision.value, job.micro_batch_size), 1.0)
        for index in (0, 1) if whole != 1.0 else ():  # the FLOPs, fp32 and 16-bit
            vector[index] *= whole
        index = FEATURES.index(f"micro_steps_z{int(job.stage)}")
        if vector[index]:  # the stage's engine: its step's share, in the candidate's precision where timed apart
            own = {stage: (factor, share) for precision, stage, factor, share in self.engine_factors
                   if precision == job.precision.value}
            factor, share = own.get(int(job.stage), (1.0, dict(self.step_shares).get(int(job.stage), 0.0)))
            vector[index] = factor * (vector[index] + share)
        for stage, share in self.recompute_shares if job.recomputed_blocks else ():
            index = FEATURES.index(f"micro_steps_z{stage}")
            vector[index] += job.micro_steps * job.recomputed_blocks * share if vector[index] else 0.0
        return tuple(vector)
