"""The study's calibrated models (pure Optuna-trial reading, no I/O).

After every trial a worker refits the study's corrections (:mod:`optimizer.perf.calibration`) from all its
measured trials, stores them in the study (``dsopt_calibration``) and uses them in the launch policy
(:mod:`optimizer.search.launch_policy`, :mod:`optimizer.search.next_launch`):

* the **memory factor** of the candidate's group (:func:`memory_group`) scales the ledger's device need (a
  candidate measured to fit is never pruned);
* the **launch margin** (:meth:`StudyModels.margin_bytes`) is the ledger's error as the study knows it — priors
  until the candidate's family has measured its own — from which the launch policy reads a probability to fit;
* the **time model** (calibrated once :data:`MIN_TIME_SAMPLES` trials are measured, the hardware profile's
  before) predicts each candidate's speed, from which the launch policy reads what a launch may gain; every
  :data:`EXPLORE_EVERY`-th proposal is left to the Optuna sampler (TPE) to explore the rest of the space.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import optuna

from optimizer.ledger.core import Verdict
from optimizer.perf.calibration import MemorySample, TimeSample, fit_rates, memory_factor
from optimizer.perf.rates import FEATURES, Rates
from optimizer.perf.throughput import StepTime, predict, profile_rates, work
from optimizer.study.knobs import Candidate, OffloadDevice, Precision, ZeroStage, parse_knob
from optimizer.study.specs import TransformerModel
from optimizer.study.study_file import StudySpec

MIN_TIME_SAMPLES = 3
"""Measured trials needed before the calibrated time model orders launches."""
EXPLORE_EVERY = 3
"""Every third proposal of a worker is the sampler's choice, the others the launch policy's."""
CALIBRATION_ATTR = "dsopt_calibration"
"""Study attribute holding the latest corrections."""
MIN_MARGIN = 0.03
"""Always kept free, as a fraction of the candidate's need: CPU-rank jitter between identical ZeRO-3 runs
(qwen2-tiny: 4.729, 4.860, 4.877 MB, 3 %); on the recorded grids a group's ratios spread by ≤ 3.7 % across
micro-batch sizes."""
ESTIMATE_PRIOR = 0.25
"""How far the *estimated* bytes (activations, transient buffers: :attr:`Ledger.estimated_bytes`) may exceed
the ledger before the candidate's family has measured its own. On the recorded grids, without offload, the
worst miss beyond :data:`MIN_MARGIN`·need is 0.28 of the estimated bytes (grid-llama-cpu z2 fp32 ckpt=full
mbs=2: +9.2 % of its need, gloo's thread freeing reduced gradients late; docs/ledger.md "Known limits"), 0.19 on
grid-cpu; the whole-need prior (:data:`PRIOR_MARGIN_CPU`) covers those rows, and before any sample every grid
row's miss is within 93 % of the prior margin. Counted bytes (model states) get no such share. Those misses are
the ledger's when the prior was set: with today's ledger, on the 12 recorded grids (benchmarks/data/grid-*.json,
2026-12-08; ``python benchmarks/margin_priors.py benchmarks/data/grid-*.json``), the worst row without offload
misses by 0.059 of its estimated bytes (grid-qlora-wide-cpu z3 bf16 ckpt=full mbs=1, +7.8 % of its need), the
next 0.011, every other is within ``MIN_MARGIN``. The prior stays: the ledger was refined on those grids, and a
model it has not seen is why a prior exists."""
ESTIMATE_PRIOR_OFFLOADED = 0.5
"""The same on CPU ranks when the optimizer or the parameters live on the host: host and device share one
memory, the device share of a measurement is the measured peak less the ledger's host items, and a miss of
those lands on it — 0.38 of the estimated bytes on grid-cpu (z2 bf16 ckpt=full mbs=1 opt->cpu, +22 % of its
small device share), 0.21 on grid-llama-cpu, since the ledger counts gloo's all-gather after the step (it was
0.85 before, docs/studies.md "The launch policy"). With today's ledger the worst offloaded row misses by 0.128
(grid-llama-cpu z2 fp32 ckpt=full mbs=2 opt->cpu, +9.4 % of its need); grid-cpu's row above is over-predicted
now. Kept, as :data:`ESTIMATE_PRIOR` is."""
PRIOR_MARGIN = 0.20
"""On a GPU, until the study has measured it, at least this fraction of the need is kept free: the allocator's
fragmentation and the CUDA context are not measured on CPU ranks. Published anchor: no OOM in 454 runs whose
estimate was under 80 % of device memory (Fujii et al. 2024, arXiv:2411.06465)."""
PRIOR_MARGIN_CPU = 0.10
"""On CPU ranks, until the study has measured it, at least this fraction of the need is kept free: the
largest whole-need under-prediction seen on CPU ranks is 8.4 % (the demo's z0 bf16 ckpt=none mbs=1, 3.137 MB
measured against 2.894 MB predicted, in runs beside other load: one bf16 copy of the parameters still live when
gloo's thread frees it late; the same candidate measured 2.896 MB alone — the ledger now names that flatten as
a risk, :attr:`~optimizer.ledger.core.Ledger.risk_bytes`), 6.9 % on the recorded grids."""
EARN_SAMPLES = 2
"""Samples (with estimated bytes) of a family after which the estimated-bytes prior gives way, for that
family, to what the study measured: one sample may be a lucky micro-batch (grid-cpu's z2 bf16 ckpt=full
opt->cpu missed by +7.7 % at micro-batch 4, +22 % at 1)."""

@dataclass(frozen=True, kw_only=True, slots=True)
class StudyModels:
    """The study's corrected models."""

    rates: Rates
    """Seconds per unit of work (calibrated, or the profile's)."""
    memory_factors: tuple[tuple[str, float], ...]
    """Measured / predicted device bytes per :func:`memory_group` with measurements (guarded, see
    :func:`optimizer.perf.calibration.memory_factor`); other groups keep the ledger's figure (factor 1)."""
    time_samples: int
    """Measured trials behind ``rates``."""
    measured_fits: frozenset[str]
    """Candidate keys measured to fit (never pruned)."""
    family_under: tuple[tuple[str, float], ...] = ()
    """Per :func:`memory_family` with samples (the same stage and offload: the same ledger items), the ledger's
    largest whole-need under-prediction seen in this study: max(measured / predicted) − 1, at least 0."""
    family_estimate: tuple[tuple[str, float], ...] = ()
    """Per :func:`memory_family` with :data:`EARN_SAMPLES` or more samples that have estimated bytes, the
    largest relative miss of them: max of (measured − predicted − :data:`MIN_MARGIN`·predicted) / estimated,
    at least 0."""
    group_spreads: tuple[tuple[str, float], ...] = ()
    """Per :func:`memory_group` with samples, how far its measurements strayed from its factor:
    max |measured / (k·predicted) − 1| (0 with one sample)."""

    def margin_bytes(self, verdict: Verdict) -> int:
        """The launch margin: the ledger's error on this candidate as the study knows it, in bytes (the launch policy
        reads it as two standard deviations, :mod:`optimizer.search.launch_policy`).

        A group with measurements: max(``MIN_MARGIN``, its own spread) of its calibrated need. Otherwise the
        larger of a share and a whole-need term. Share: ``MIN_MARGIN``·need + u·estimated, u the family's own
        ``family_estimate`` once it has one, :data:`ESTIMATE_PRIOR` (:data:`ESTIMATE_PRIOR_OFFLOADED` on CPU
        ranks with offload) before. Whole need: the worst
        under-prediction the study saw in the candidate's family (same stage and offload); :data:`PRIOR_MARGIN`
        (GPU) or :data:`PRIOR_MARGIN_CPU` while the family has no sample — another family's error says little
        about this one's items. Both ways the margin is at least ``MIN_MARGIN``·need + the ledger's
        :attr:`~optimizer.ledger.core.Ledger.risk_bytes` (items live in some runs only: priced, never a veto)."""
        ledger = verdict.ledger
        assert ledger is not None
        need = ledger.training_needed_bytes
        risk = ledger.risk_bytes
        if memory_group(verdict.candidate) in dict(self.memory_factors):
            spread = dict(self.group_spreads).get(memory_group(verdict.candidate), 0.0)
            calibrated = self.memory_factor(verdict.candidate) * need
            return math.ceil(max(max(MIN_MARGIN, spread) * calibrated, MIN_MARGIN * calibrated + risk))
        family = memory_family(verdict.candidate)
        c = verdict.candidate
        offloaded = c.offload_optimizer is not OffloadDevice.NONE or c.offload_param is not OffloadDevice.NONE
        u = dict(self.family_estimate).get(
            family, ESTIMATE_PRIOR_OFFLOADED if offloaded and ledger.device_is_host else ESTIMATE_PRIOR)
        prior = PRIOR_MARGIN_CPU if ledger.device_is_host else PRIOR_MARGIN
        whole = dict(self.family_under).get(family, prior)
        margin = max(MIN_MARGIN * need + u * ledger.estimated_bytes + risk, whole * need)
        return math.ceil(margin)

    def memory_factor(self, candidate: Candidate) -> float:
        """The correction of ``candidate``'s group (1 where nothing of its group was measured)."""
        return dict(self.memory_factors).get(memory_group(candidate), 1.0)

    def to_attr(self) -> dict[str, object]:
        """JSON for the study attribute."""
        return {"seconds_per": dict(zip(FEATURES, self.rates.seconds_per, strict=True)),
                "source": self.rates.source, "memory_factors": dict(self.memory_factors),
                "time_samples": self.time_samples}


def memory_group(candidate: Candidate) -> str:
    """Candidates whose ledger error is alike: the same stage, precision, checkpointing and offload — the
    ledger's terms differ between groups (measured on grid-cpu: under ZeRO-0 bf16 without checkpointing the
    ledger is 5–17 % low, with full checkpointing within 3 %), so one study-wide factor would carry one
    group's error into another."""
    k = candidate.knobs()
    return f"z{k['zero_stage']}-{k['precision']}-{k['checkpointing']}-opt{k['offload_optimizer']}-p{k['offload_param']}"


def memory_family(candidate: Candidate) -> str:
    """Candidates whose ledger holds the same items (same ZeRO stage and offload; checkpointing and micro-batch
    change only their sizes, and so does precision at stages 1–3, which keep an fp32 master partition in fp32
    training too): a whole-need error seen in one is the likeliest in the others. At stage 0 fp32 and mixed
    precision are two families: fp32 steps FusedAdam on the parameters, bf16/fp16 go through FP16_Optimizer
    (a flat fp32 master, fp32 gradient copies in the step, DeepSpeed's runtime/fp16/fused_optimizer.py) — in
    the demo an fp32 sample earned z0 bf16 ckpt=none mbs=1 a 3 % margin and it measured 8.4 % over its need."""
    k = candidate.knobs()
    stage0 = "-mixed" if candidate.zero_stage is ZeroStage.DISABLED and candidate.precision is not Precision.FP32 \
        else ""
    return f"z{k['zero_stage']}{stage0}-opt{k['offload_optimizer']}-p{k['offload_param']}"


def candidate_of(knobs: dict[str, object], base: Candidate) -> Candidate:
    """The candidate a trial's ``candidate`` attribute describes."""
    return replace(base, **{name: parse_knob(name, str(value)) for name, value in knobs.items()})


def measured_trials(trials: Iterable[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """Trials that launched and measured (not reused)."""
    return [t for t in trials if t.state is optuna.trial.TrialState.COMPLETE and "reused_from" not in t.user_attrs
            and "step_time_s" in t.user_attrs]


def over_budget_trials(trials: Iterable[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """Trials that measured a device share over the budget (outcome ``oom``: ran to the end, see
    :func:`optimizer.search.objective.over_budget`, or stopped when it went over): their memory is a real
    measurement, and their step time where they reached the measured steps."""
    return [t for t in trials if t.state is optuna.trial.TrialState.FAIL and t.user_attrs.get("outcome") == "oom"
            and "reused_from" not in t.user_attrs and "device_share_bytes" in t.user_attrs]


def device_bytes_measured(trial: optuna.trial.FrozenTrial) -> int:
    """What training measured of one device — its reserved (CPU: live-tensor) peak + the device reserve, the
    memory objective — minus the ledger's host share (CPU ranks keep offloaded states in the same memory).
    Trials recorded before training was measured apart give their whole-run allocated peak."""
    attrs = trial.user_attrs
    if "device_share_bytes" in attrs:
        return int(attrs["device_share_bytes"])
    measured = attrs.get("memory_objective_bytes") or attrs.get("peak_memory_bytes") or 0
    return int(measured) - int(attrs.get("predicted_host_bytes", 0))


def estimated_bytes(trial: optuna.trial.FrozenTrial) -> int:
    """The ledger's estimated bytes of the trial's candidate (:attr:`Ledger.estimated_bytes`; 0 for trials
    recorded before it was kept)."""
    return int(trial.user_attrs.get("predicted_estimated_bytes", 0))


def device_bytes_predicted(trial: optuna.trial.FrozenTrial) -> int:
    """The ledger's device need of training alone (reserved + device reserve), the counterpart of
    :func:`device_bytes_measured` (the whole-run need for trials recorded before it existed)."""
    attrs = trial.user_attrs
    return int(attrs.get("predicted_training_needed_bytes") or attrs.get("predicted_gpu_needed_bytes") or 0)


def study_models(*, spec: StudySpec, trials: Sequence[optuna.trial.FrozenTrial], base: Candidate) -> StudyModels:
    """Fit the corrections from the study's measured trials."""
    assert isinstance(spec.model, TransformerModel)
    budget = spec.hardware.gpu_memory_bytes
    measured = measured_trials(trials)
    time_samples, fits = [], set()
    memory_samples: dict[str, list[MemorySample]] = {}
    group_family: dict[str, str] = {}
    for t in measured:
        candidate = candidate_of(t.user_attrs["candidate"], base)
        job = work(candidate=candidate, model=spec.model, hardware=spec.hardware, training=spec.training)
        if t.user_attrs.get("step_time_s"):
            time_samples.append(TimeSample(work=job, step_time_s=float(t.user_attrs["step_time_s"])))
        device = device_bytes_measured(t)
        needed = device_bytes_predicted(t)
        if needed and device > 0:
            fit = device <= budget
            group_family[memory_group(candidate)] = memory_family(candidate)
            memory_samples.setdefault(memory_group(candidate), []).append(MemorySample(
                predicted_bytes=needed, measured_bytes=device, fits_budget_bytes=budget if fit else None,
                estimated_bytes=estimated_bytes(t)))
            if fit:
                fits.add(t.user_attrs["label"])
    for t in over_budget_trials(trials):  # a run measured over the budget: its time and its device share
        candidate = candidate_of(t.user_attrs["candidate"], base)
        job = work(candidate=candidate, model=spec.model, hardware=spec.hardware, training=spec.training)
        if t.user_attrs.get("step_time_s"):
            time_samples.append(TimeSample(work=job, step_time_s=float(t.user_attrs["step_time_s"])))
        if device_bytes_predicted(t):
            group_family[memory_group(candidate)] = memory_family(candidate)
            memory_samples.setdefault(memory_group(candidate), []).append(MemorySample(
                predicted_bytes=device_bytes_predicted(t), measured_bytes=max(device_bytes_measured(t), budget + 1),
                fits_budget_bytes=None, estimated_bytes=estimated_bytes(t)))
    for t in trials:  # an OOM that measured nothing says only that the need exceeded the budget: a lower bound
        if t.state is optuna.trial.TrialState.FAIL and t.user_attrs.get("outcome") == "oom" \
                and "reused_from" not in t.user_attrs and t.user_attrs.get("predicted_gpu_needed_bytes") \
                and "device_share_bytes" not in t.user_attrs:
            candidate = candidate_of(t.user_attrs["candidate"], base)
            group_family[memory_group(candidate)] = memory_family(candidate)
            memory_samples.setdefault(memory_group(candidate), []).append(MemorySample(
                predicted_bytes=int(t.user_attrs["predicted_gpu_needed_bytes"]), measured_bytes=budget + 1,
                fits_budget_bytes=None, estimated_bytes=estimated_bytes(t)))
    prior = profile_rates(hardware=spec.hardware)
    rates = fit_rates(time_samples, prior=prior) if len(time_samples) >= MIN_TIME_SAMPLES else prior
    factors = tuple(sorted((group, memory_factor(samples)) for group, samples in memory_samples.items()))
    every = [(group, s) for group, samples in memory_samples.items() for s in samples if s.predicted_bytes > 0]
    k = dict(factors)
    misses: dict[str, list[float]] = {}
    for group, sample in every:
        if sample.estimated_bytes > 0:
            miss = (sample.measured_bytes - (1 + MIN_MARGIN) * sample.predicted_bytes) / sample.estimated_bytes
            misses.setdefault(group_family[group], []).append(max(0.0, miss))
    spreads: dict[str, float] = {}
    for group, sample in every:
        stray = abs(sample.measured_bytes / (k[group] * sample.predicted_bytes) - 1)
        spreads[group] = max(spreads.get(group, 0.0), stray)
    family: dict[str, float] = {}
    for group, samples in memory_samples.items():
        name = group_family[group]
        for sample in samples:
            if sample.predicted_bytes > 0:
                family[name] = max(family.get(name, 0.0), sample.measured_bytes / sample.predicted_bytes - 1)
    return StudyModels(rates=rates, memory_factors=factors, time_samples=len(time_samples),
                       measured_fits=frozenset(fits), family_under=tuple(sorted(family.items())),
                       family_estimate=tuple(sorted((name, max(values)) for name, values in misses.items()
                                                    if len(values) >= EARN_SAMPLES)),
                       group_spreads=tuple(sorted(spreads.items())))


def predicted_speed(candidate: Candidate, *, spec: StudySpec, models: StudyModels) -> StepTime | str:
    """The (calibrated) throughput model's prediction for ``candidate``."""
    assert isinstance(spec.model, TransformerModel)
    job = work(candidate=candidate, model=spec.model, hardware=spec.hardware, training=spec.training)
    return predict(job=job, rates=models.rates, ranks=spec.hardware.world_size)
