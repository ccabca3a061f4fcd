"""The study file's ``trial`` section as a spec: how a short real trial runs and is judged (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from optimizer.study.knobs import Precision
from optimizer.study.script_command import ScriptCommand

TIMEOUT_MARGIN = 3.0
"""How many times its predicted duration a launch may take before it is called a timeout: the throughput model
is a prior (MFU 0.4) until calibrated, and a step's real time can be a few times it (CPU Adam, first-step
allocations, JIT builds). A margin, not a measured figure."""

INIT_STEPS = 2
"""Model construction and ``deepspeed.initialize`` counted as this many steps in the launch's time budget."""

@dataclass(frozen=True, kw_only=True, slots=True)
class TrialSettings:
    """How a short real trial runs and is judged (the study file's optional ``trial`` section)."""

    warmup_steps: int = 2
    """Optimizer steps before timing; the CPU live-tensor peak is recorded over these (≥ 2 so that the
    optimizer states exist during a backward pass)."""
    measured_steps: int = 3
    """Timed optimizer steps."""
    timeout_s: float = 300.0
    """Wall-clock limit of one launch, at least: past it the whole process group is killed (outcome ``timeout``).
    Where the throughput model predicts the step time, the limit grows with it (:meth:`timeout_for`)."""
    seed: int = 0
    """Seed of the model initialisation and the synthetic data: every trial sees the same batches."""
    retries: int = 1
    """Launches again after a ``crash`` or ``timeout`` — a port race, an NCCL hiccup, a co-tenant — before the
    outcome is recorded as the candidate's (and reused); OOM, NaN and unsupported are never retried."""
    fidelity_tolerance: tuple[tuple[Precision, float], ...] = (
        (Precision.FP32, 1e-4), (Precision.BF16, 2e-2), (Precision.FP16, 5e-2))
    """Largest accepted relative loss deviation from the FP32 reference, per precision. fp32: ZeRO 1–3 only
    reorder reductions (measured ≤ 1e-7 on cpu-tiny); bf16: 8-bit mantissa (measured 3.3e-3 over 5 steps
    on cpu-tiny, tolerance ≈ 6×); fp16: dynamic loss scaling may skip early overflowing steps."""

    command: ScriptCommand | None = None
    """The user's own training script as the trial (``trial.command``, :mod:`optimizer.study.script_command`);
    None: dsopt's own training step."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 2 or self.measured_steps < 1:
            raise ValueError("warmup_steps must be >= 2 and measured_steps >= 1")
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        if self.retries < 0:
            raise ValueError("retries must be >= 0")

    def timeout_for(self, predicted_step_s: float | None) -> float:
        """The launch's wall-clock limit: ``timeout_s``, or — when the throughput model predicts a step of
        ``predicted_step_s`` — :data:`TIMEOUT_MARGIN` × (warm-up + measured steps + :data:`INIT_STEPS`) steps, if
        longer. A 70B step with offload takes minutes; a fixed limit would record every such trial as a timeout."""
        if predicted_step_s is None:
            return self.timeout_s
        steps = self.warmup_steps + self.measured_steps + INIT_STEPS
        return max(self.timeout_s, TIMEOUT_MARGIN * steps * predicted_step_s)

    def tolerance(self, precision: Precision) -> float:
        """The fidelity tolerance for ``precision``."""
        return dict(self.fidelity_tolerance)[precision]
