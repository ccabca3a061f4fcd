"""Planning table for big models: dsopt's ledger beside the ZeRO papers and DeepSpeed's own estimators.

    .venv/bin/python benchmarks/big_models.py

Pure computation (no GPU, no process; DeepSpeed is imported only for its two estimators). Each model × hardware
row judges 36 candidates — zero_stage 0–3 × offload_optimizer × offload_param (none/cpu/nvme), the device's
16-bit precision, full checkpointing, micro-batch 1, global batch = ranks — with :func:`optimizer.ledger.core.evaluate`,
and the script prints a one-line header, a markdown table, then one line per disagreement. GB = 10^9 bytes.

Hardware (NVIDIA DGX datasheets; assumptions, not measured): DGX-2 = 16 × V100 SXM3 32 GB, 1.5 TB RAM, 30 TB NVMe
(8 × 3.84 TB), no bf16 on Volta — the ``1×V100`` rows give one V100 the whole node's RAM and NVMe; DGX A100 (640 GB)
= 8 × A100 80 GB, 2 TB RAM, 30 TB NVMe; DGX H100 = 8 × H100 80 GB, 2 TB RAM, 30 TB NVMe. HBM taken as 32 / 80 GiB,
device_reserve 1 GiB, allocator_overhead 0.12, nvme_path /local_nvme, as studies/llama-7b-8xh100.yaml.

Sources:
(a) ZeRO paper (Rajbhandari et al. 2020, §3): mixed-precision Adam keeps 16Ψ bytes; ZeRO-3 over N ranks: 16Ψ/N.
(b) DeepSpeed 0.19.8 ``stage3.py: estimate_zero3_model_states_mem_needs`` → ``(cpu, gpu, largest_layer)`` bytes
    (CPU first), params + optimizer on the CPU: GPU = 4·largest layer; ``stage_1_and_2.py:
    estimate_zero2_model_states_mem_needs`` → ``(cpu, gpu)``, no offload: GPU = 2Ψ + 18Ψ/N. Model states only.
(c) ZeRO-Offload (Ren et al., ATC'21): 13B on one 32 GB V100 with ZeRO-2 + CPU optimizer offload. Its exact 13B
    layout is not in our references; "GPT 13B" is GPT-3's 13B shape (40 layers, h 5120, 40 heads; Brown et al.
    2020) at Megatron's seq 1024, eager attention, dropout. DeepSpeed's tutorial (docs/_tutorials/zero-offload.md)
    trains a 10B GPT-2 (50 layers, h 4096, 32 heads, batch 10/GPU, --checkpoint-activations) that way on one
    V100 32 GB: the "GPT 10B" row. ZeRO-Infinity (Rajbhandari et al., SC'21): one DGX-2 holds 1T parameters with
    NVMe offload — 62.5B per V100, read as "z3 opt->nvme param->nvme fits one V100 for Ψ ≤ 62.5B"; the ~1T row
    (assumed shape: 128 layers, h 25600, 160 heads, seq 1024) checks it on the 16-V100 node. Issue goals:
    Llama-2-70B on 8 × 80 GB has fitting ZeRO-3 + offload candidates; a 7B at ZeRO-0 does not fit.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

from optimizer.ledger.core import Category, Ledger, Location, Phase, Verdict, evaluate
from optimizer.ledger.items import TRANSIENT_PHASES, LedgerItem
from optimizer.ledger.transformer import largest_layer_parameters, parameter_count
from optimizer.study.knobs import Candidate, with_knobs
from optimizer.study.search_space import parse_search_space
from optimizer.study.specs import (
    AttentionKind,
    HardwareSpec,
    MlpKind,
    ModelInit,
    NormKind,
    Optimizer,
    PositionKind,
    Precision,
    TrainingSpec,
    TransformerModel,
    baseline_candidate,
)
from optimizer.study.units import GB, GiB

INFINITY_SHARE = 1_000_000_000_000 // 16
"""ZeRO-Infinity: 1T parameters on one DGX-2 (16 V100) → parameters per V100."""
OFFLOADS = ("none", "cpu", "nvme")
NOT_STATES = (Category.ACTIVATIONS, Category.BUFFERS)
"""Ledger categories that are not model states: what the 16Ψ arithmetic and DeepSpeed's estimators leave out."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Claim:
    """A published statement: some candidate among ``knobs`` fits (``fits``) or none does."""

    source: str
    """Short name of the source, shown in the table."""
    knobs: tuple[dict[str, object], ...]
    """Knob overrides; precision, checkpointing and micro-batch come from the row."""
    fits: bool
    """What the source says."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One table row: a model shape on one hardware, at one sequence length and micro-batch."""

    model_name: str
    model: TransformerModel
    sequence_length: int
    """Tokens per sample."""
    hardware_name: str
    hardware: HardwareSpec
    micro_batch_size: int = 1
    """Samples per GPU per step (global batch = this × ranks)."""
    claims: tuple[Claim, ...] = ()


def _gpt(layers: int, h: int, heads: int, seq: int, attention: AttentionKind = AttentionKind.EAGER) -> TransformerModel:
    """GPT-2/GPT-3 shape: 4h GELU MLP, LayerNorm, learned positions, tied embeddings, biases, dropout."""
    return TransformerModel(layers=layers, hidden_size=h, heads=heads, kv_heads=heads, ffn_size=4 * h,
                            vocab_size=50257, attention=attention, max_positions=seq)


def _llama(layers: int, h: int, heads: int, kv_heads: int, ffn: int) -> TransformerModel:
    """Llama-2 shape as in studies/llama-7b-8xh100.yaml: SwiGLU, RMSNorm, rope, no bias, untied, flash, no dropout."""
    return TransformerModel(layers=layers, hidden_size=h, heads=heads, kv_heads=kv_heads, ffn_size=ffn,
                            vocab_size=32000, tied_embeddings=False, attention=AttentionKind.FUSED,
                            mlp=MlpKind.SWIGLU, norm=NormKind.RMSNORM, bias=False,
                            position_embedding=PositionKind.ROPE, dropout=False)


def _dgx(gpus: int, gpu_gib: int, host_tb: float, *, volta: bool = False) -> HardwareSpec:
    """One DGX node's figures (module docstring); Volta lacks bf16."""
    precisions = (Precision.FP32, Precision.FP16) if volta else (Precision.FP32, Precision.BF16, Precision.FP16)
    return HardwareSpec(gpus_per_node=gpus, gpu_memory_bytes=gpu_gib * GiB, device_reserve_bytes=GiB,
                        allocator_overhead=0.12, host_memory_bytes=int(host_tb * 10**12), nvme_path="/local_nvme",
                        nvme_bytes=30 * 10**12, supported_precisions=precisions)


def cases() -> list[Case]:
    """The rows: five models on three machines, then the three rows that check the papers directly."""
    v100, a100, h100 = _dgx(1, 32, 1.5, volta=True), _dgx(8, 80, 2.0), _dgx(8, 80, 2.0)
    machines = (("1×V100 32GB", v100), ("8×A100 80GB", a100), ("8×H100 80GB", h100))
    infinity = Claim(source="ZeRO-Inf", knobs=({"zero_stage": 3, "offload_optimizer": "nvme",
                                                "offload_param": "nvme"},), fits=True)
    goal_70b = Claim(source="goal 70B", fits=True, knobs=tuple(
        {"zero_stage": 3, "offload_optimizer": o, "offload_param": p}
        for o in OFFLOADS for p in OFFLOADS if (o, p) != ("none", "none")))
    goal_7b = Claim(source="goal 7B z0", knobs=({"zero_stage": 0},), fits=False)
    models = (("GPT-2 1.5B", _gpt(48, 1600, 25, 1024), 1024),
              ("Llama-2-7B", _llama(32, 4096, 32, 32, 11008), 4096),
              ("Llama-2-13B", _llama(40, 5120, 40, 40, 13824), 4096),
              ("Llama-2-70B", _llama(80, 8192, 64, 8, 28672), 4096),
              ("GPT-3 175B", _gpt(96, 12288, 96, 2048, AttentionKind.FUSED), 2048))
    rows = []
    for name, model, seq in models:
        for hw_name, hw in machines:
            claims: list[Claim] = []
            if hw is v100 and parameter_count(model) <= INFINITY_SHARE:
                claims.append(infinity)
            if name == "Llama-2-70B" and hw is not v100:
                claims.append(goal_70b)
            if name == "Llama-2-7B":
                claims.append(goal_7b)
            rows.append(Case(model_name=name, model=model, sequence_length=seq, hardware_name=hw_name, hardware=hw,
                             claims=tuple(claims)))
    offload = Claim(source="ZeRO-Offload", knobs=({"zero_stage": 2, "offload_optimizer": "cpu"},), fits=True)
    rows += [
        Case(model_name="GPT 13B (40×5120)", model=_gpt(40, 5120, 40, 1024), sequence_length=1024,
             hardware_name="1×V100 32GB", hardware=v100, claims=(offload, infinity)),
        Case(model_name="GPT 10B (50×4096), mbs 10", model=_gpt(50, 4096, 32, 1024), sequence_length=1024,
             hardware_name="1×V100 32GB", hardware=v100, micro_batch_size=10,
             claims=(replace(offload, source="Offload tutorial"), infinity)),
        Case(model_name="GPT ~1T (128×25600)", model=_gpt(128, 25600, 160, 1024), sequence_length=1024,
             hardware_name="16×V100 32GB (DGX-2)", hardware=_dgx(16, 32, 1.5, volta=True),
             claims=(replace(infinity, source="ZeRO-Inf 1T"),)),
    ]
    return rows


def _precision(hardware: HardwareSpec) -> Precision:
    """The device's 16-bit precision: bf16 where supported, else fp16."""
    return Precision.BF16 if Precision.BF16 in hardware.supported_precisions else Precision.FP16


def _training(case: Case, model_init: ModelInit) -> TrainingSpec:
    return TrainingSpec(global_batch_size=case.micro_batch_size * case.hardware.world_size,
                        micro_batch_size=case.micro_batch_size, sequence_length=case.sequence_length,
                        optimizer=Optimizer.ADAMW, model_init=model_init)


def _judge(case: Case, candidate: Candidate, model_init: ModelInit = ModelInit.AUTO) -> Verdict:
    return evaluate(candidate=candidate, model=case.model, hardware=case.hardware,
                    training=_training(case, model_init))


def _grid(case: Case) -> list[Candidate]:
    """The row's 36 candidates, built as the search does (parse_search_space + SearchSpace.candidates)."""
    raw = {"knobs": {"zero_stage": [0, 1, 2, 3], "offload_optimizer": list(OFFLOADS),
                     "offload_param": list(OFFLOADS), "precision": [_precision(case.hardware).value],
                     "checkpointing": ["full"], "micro_batch_size": [case.micro_batch_size]}}
    space = parse_search_space(raw, source="benchmarks/big_models.py")
    return list(space.candidates(baseline_candidate(_training(case, ModelInit.AUTO))))


def _candidate(case: Case, knobs: dict[str, object]) -> Candidate:
    """One candidate of the row's grid: ``knobs`` over 16-bit, full checkpointing, the row's micro-batch."""
    base = {"precision": _precision(case.hardware).value, "checkpointing": "full",
            "micro_batch_size": case.micro_batch_size}
    return with_knobs(baseline_candidate(_training(case, ModelInit.AUTO)), {**base, **knobs})


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / GB:.1f}"


def _items(items: list[LedgerItem], scale: int) -> str:
    """Items ≥ 3 % of their sum, largest first, in GB × ``scale`` (ranks per node for host and NVMe);
    ``*`` marks what is not a model state."""
    total = sum(i.bytes for i in items)
    shown = sorted((i for i in items if i.bytes >= 0.03 * total), key=lambda i: -i.bytes)
    parts = [f"{'*' if i.category in NOT_STATES else ''}{i.name} {_gb(scale * i.bytes)}" for i in shown]
    return "; ".join([*parts, f"other {_gb(scale * (total - sum(i.bytes for i in shown)))}"])


def _needed(ledger: Ledger, allocated: int) -> int:
    """Device bytes for an allocated peak, as the ledger's verdict counts them (overhead + reserve)."""
    return math.ceil(allocated * (1.0 + ledger.allocator_overhead)) + ledger.device_reserve_bytes


def _breakdown(ledger: Ledger, location: Location = Location.GPU) -> str:
    """The peak at ``location`` item by item and, when init is that peak, the peak with init left aside."""
    scale = 1 if location is Location.GPU else ledger.ranks_per_node
    items = ledger.peak_items_at(location)
    text = f"{location} peak in {ledger.peak_phase_at(location)}: {_items(items, scale)}"
    if location is Location.GPU:
        total = sum(i.bytes for i in items)
        overhead = _needed(ledger, total) - total - ledger.device_reserve_bytes
        text += (f"; *allocator ×{1 + ledger.allocator_overhead:.2f} +{_gb(overhead)}"
                 f"; *device reserve {_gb(ledger.device_reserve_bytes)}")
    if ledger.peak_phase_at(location) is not Phase.INIT:
        return text
    phase = max(TRANSIENT_PHASES, key=lambda ph: sum(i.bytes for i in ledger.items
                                                      if i.location is location and i.phase is ph))
    live = [i for i in ledger.items if i.location is location and i.phase in (Phase.ALWAYS, phase)]
    allocated = sum(i.bytes for i in live)
    need, cap = ((_needed(ledger, allocated), ledger.gpu_capacity_bytes) if location is Location.GPU
                 else (scale * allocated, ledger.host_capacity_bytes))
    verdict = "fits" if cap is None or need <= cap else "does not fit"
    return f"{text} || OUTSIDE INIT the {location} peak is {phase}: {_gb(need)} GB, {verdict}: {_items(live, scale)}"


def _deepspeed_estimators() -> tuple[Callable[..., tuple[int, ...]], Callable[..., tuple[int, ...]], str]:
    """DeepSpeed's two estimators and its version; its import-time log lines go to stderr, not the table."""
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed
        import torch
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    versions = f"deepspeed {deepspeed.__version__}, torch {torch.__version__}"
    return estimate_zero3_model_states_mem_needs, estimate_zero2_model_states_mem_needs, versions


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """One source checked against dsopt on one row; ``explanation`` says why not when it disagrees."""

    name: str
    agrees: bool
    explanation: str = ""


def _estimator_check(case: Case, name: str, est_gpu: int, knobs: dict[str, object]) -> tuple[Check, Ledger | None]:
    """Agree when both say the same about the GPU and dsopt's allocated peak is not below the estimate."""
    ledger = _judge(case, _candidate(case, knobs)).ledger
    if ledger is None:
        return Check(name=name, agrees=False, explanation=f"{name}: dsopt calls the candidate invalid"), None
    cap = case.hardware.gpu_memory_bytes
    agrees = (est_gpu <= cap) == ledger.fits_gpu and ledger.per_gpu()["total"] >= est_gpu
    side = "under" if est_gpu <= cap else "over"
    why = (f"{name} {ledger.candidate.label()}: DeepSpeed {_gb(est_gpu)} GB/GPU ({side} {_gb(cap)}), dsopt "
           f"{_gb(ledger.gpu_needed_bytes)} ({'fits' if ledger.fits_gpu else 'does not fit'}); {_breakdown(ledger)}")
    return Check(name=name, agrees=agrees, explanation="" if agrees else why), ledger


def _claim_check(case: Case, claim: Claim) -> Check:
    """Does dsopt's verdict on the claim's candidates say what the source says?"""
    verdicts = [_judge(case, _candidate(case, k)) for k in claim.knobs]
    valid = [v for v in verdicts if v.ledger is not None]
    fits = any(v.fits for v in verdicts)
    if fits == claim.fits:
        return Check(name=claim.source, agrees=True)
    if not valid:
        return Check(name=claim.source, agrees=False,
                     explanation=f"{claim.source}: invalid in dsopt: {verdicts[0].invalid_reasons}")
    shown = min(valid, key=lambda v: v.ledger.gpu_needed_bytes) if claim.fits else next(v for v in valid if v.fits)
    ledger = shown.ledger
    assert ledger is not None
    said = "fits" if claim.fits else "does not fit"
    reasons = "; ".join(ledger.verdict_reasons()) or "fits"
    failing = [loc for loc, ok in ((Location.GPU, ledger.fits_gpu), (Location.HOST, ledger.fits_host),
                                   (Location.NVME, ledger.fits_nvme)) if ok is False] or [Location.GPU]
    stories = " || ".join(_breakdown(ledger, loc) for loc in failing)
    return Check(name=claim.source, agrees=False,
                 explanation=f"{claim.source} says {ledger.candidate.label()} {said}; dsopt: {reasons}; {stories}")


def _fit_cells(case: Case) -> list[str]:
    """Fitting candidates (model_init auto / full), the smallest-memory one, the lowest stage without offload."""
    grid = _grid(case)
    fitting = [v for v in (_judge(case, c) for c in grid) if v.fits and v.ledger is not None]
    full = sum(_judge(case, c, ModelInit.FULL).fits for c in grid)
    needs = sorted((v.ledger.gpu_needed_bytes, v.candidate.label()) for v in fitting if v.ledger is not None)
    plain = [int(v.candidate.zero_stage) for v in fitting
             if v.candidate.offload_optimizer.value == v.candidate.offload_param.value == "none"]
    return [f"{len(fitting)} / {full}", f"{needs[0][1]} ({_gb(needs[0][0])})" if needs else "none",
            f"z{min(plain)}" if plain else "none"]


def _source_cells(case: Case, estimators: tuple[Callable[..., tuple[int, ...]], ...]) -> tuple[list[str], list[Check]]:
    """Columns (a) and (b), and every check of the row: 16Ψ/N, the two estimators, the published claims."""
    z3_estimate, z2_estimate = estimators
    hw = case.hardware
    psi, cap = parameter_count(case.model), hw.gpu_memory_bytes
    # (a) over the memory, dsopt's plain ZeRO-3 must not fit; dsopt's ZeRO-3 model states must reach 16Ψ/N.
    zero = 16 * psi // hw.world_size
    z3 = _judge(case, _candidate(case, {"zero_stage": 3})).ledger
    assert z3 is not None
    states = sum(i.bytes for i in z3.items if i.location is Location.GPU and i.phase is Phase.ALWAYS
                 and i.category not in NOT_STATES)
    paper = Check(name="16Ψ/N", agrees=(zero <= cap or not z3.fits_gpu) and states >= zero,
                  explanation=f"16Ψ/N {_gb(zero)} GB vs dsopt z3 model states {_gb(states)}; {_breakdown(z3)}")
    # (b) DeepSpeed's estimators, called for real: (cpu, gpu, largest layer) and (cpu, gpu) bytes.
    _, est3, _ = z3_estimate(psi, largest_layer_parameters(case.model), num_gpus_per_node=hw.gpus_per_node,
                             num_nodes=hw.nodes, cpu_offload=True, cpu_offload_params=True, zero_init=True)
    _, est2 = z2_estimate(psi, num_gpus_per_node=hw.gpus_per_node, num_nodes=hw.nodes, cpu_offload=False)
    check3, l3 = _estimator_check(case, "DS z3 est", est3,
                                  {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"})
    check2, l2 = _estimator_check(case, "DS z2 est", est2, {"zero_stage": 2})
    cells = [f"{_gb(zero)} ({'<' if zero <= cap else '>'} {_gb(cap)})",
             f"{_gb(est3)} / {_gb(l3.gpu_needed_bytes) if l3 else '–'}",
             f"{_gb(est2)} / {_gb(l2.gpu_needed_bytes) if l2 else '–'}",
             "; ".join(f"{c.source}: {'fits' if c.fits else 'no fit'}" for c in case.claims) or "–"]
    return cells, [paper, check3, check2, *(_claim_check(case, c) for c in case.claims)]


def _row(case: Case, estimators: tuple[Callable[..., tuple[int, ...]], ...]) -> tuple[str, list[str]]:
    """The table line of ``case`` and its disagreement lines."""
    cells, checks = _source_cells(case, estimators)
    line = " | ".join([case.model_name, f"{parameter_count(case.model) / 1e9:.2f}B", case.hardware_name,
                       *_fit_cells(case), *cells,
                       "; ".join(f"{c.name} {'yes' if c.agrees else 'NO'}" for c in checks)])
    where = f"{case.model_name} on {case.hardware_name}"
    return f"| {line} |", [f"- {where}: {c.explanation}" for c in checks if not c.agrees]


HEADER = ("| model | Ψ | hardware | fit (auto / full) | smallest fitting (GB/GPU) | lowest z, no offload | "
          "(a) 16Ψ/N GB vs GPU | (b) DS z3 cpu+cpu est / dsopt GB | (b) DS z2 est / dsopt GB | (c) published | "
          "agrees? |")


def main() -> int:
    z3_estimate, z2_estimate, versions = _deepspeed_estimators()
    print(f"big_models.py {datetime.date.today().isoformat()}: {versions}, Python {platform.python_version()}; "
          "GB = 10^9 bytes; dsopt GB = reserved peak ×1.12 + 1 GiB reserve; 36 candidates per row")
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    notes: list[str] = []
    for case in cases():
        line, why = _row(case, (z3_estimate, z2_estimate))
        print(line)
        notes += why
    print()
    print("Disagreements (* = not a model state: what DeepSpeed's estimators and the 16Ψ arithmetic leave out):"
          if notes else "No disagreements.")
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
