"""The time model's seconds per unit from the machine's probe (pure): :func:`probed_rates`.

:mod:`optimizer.perf.throughput` takes these figures instead of the hardware profile's wherever the study carries a
probe (:attr:`optimizer.study.specs.HardwareSpec.probe`); :mod:`optimizer.perf.probe_plan` says what the probe
times, :mod:`optimizer.perf.skeleton` on what model DeepSpeed's engine is timed.
"""

from __future__ import annotations

from optimizer.perf.probe_plan import collective_beta, compute_rate
from optimizer.perf.rates import FEATURES, Rates
from optimizer.study.knobs import Precision, ZeroStage
from optimizer.study.machine_probe import PASS_INTERCEPT, MachineProbe, ProbeFigure
from optimizer.study.specs import HardwareSpec


def probed_rates(rates: Rates, *, hardware: HardwareSpec, probe: MachineProbe) -> Rates:
    """``rates`` with every figure the probe measured taken from it (:mod:`optimizer.perf.probe_plan`): seconds per
    FLOP of the model's own GEMMs and attention at the study's middle micro-batch (the others as
    :attr:`Rates.flop_factors`); per byte moved of the all-reduce (ZeRO 0–2: each rank moves 2·(W−1)/W of the
    buffer) and of the all-gather (ZeRO-3: (W−1)/W), the bandwidth slope β of each (a call's latency is left to
    the per-micro-step figures: :func:`optimizer.perf.probe_plan.collective_beta`); per byte of a pinned
    host↔device copy (the offload buffers are pinned; CPU ranks: a host copy); per parameter of DeepSpeedCPUAdam's
    step; per byte of NVMe (write and read together) and of device memory (QLoRA's dequantization); per micro-step of
    DeepSpeed's engine at each ZeRO stage, its optimizer step's extra as :attr:`Rates.step_shares` and recomputation's
    as :attr:`Rates.recompute_shares` (the skeleton's micro-steps, :mod:`optimizer.perf.skeleton`), in the space's
    16-bit precision where it has one, the other precisions' engines as :attr:`Rates.engine_factors`; the model's own
    pass at each precision and micro-batch as :attr:`Rates.pass_factors` (:func:`pass_factors`). ``source`` names
    which figures came from where. Multi-node studies keep the profile's link: the probe times one node's ranks."""
    seconds = list(rates.seconds_per)
    probed: list[str] = []

    def take(feature: str, value: float | None) -> None:
        if value is not None and value > 0:
            seconds[FEATURES.index(feature)] = value
            probed.append(feature)

    half = Precision.BF16 if Precision.BF16 in hardware.supported_precisions else Precision.FP16
    factors: list[tuple[str, int, float]] = []
    for feature, precision in (("flops_fp32", Precision.FP32), ("flops_16bit", half)):
        measured = sorted({f.micro_batch for f in probe.of_kind("gemm") if f.precision == precision.value})
        by_batch = {b: compute_rate(probe, precision=precision.value, micro_batch=b) for b in measured}
        by_batch = {b: r for b, r in by_batch.items() if r}
        if not by_batch:
            continue
        reference = sorted(by_batch)[len(by_batch) // 2]  # the middle one: the others are factors of it
        take(feature, by_batch[reference])
        factors += [(precision.value, b, r / by_batch[reference]) for b, r in by_batch.items()]
    ring = (probe.ranks - 1) / probe.ranks
    if hardware.nodes == 1 and ring > 0:
        reduce, gather = collective_beta(probe, "all_reduce"), collective_beta(probe, "all_gather")
        take("comm_bytes", reduce and reduce / (2 * ring))
        take("comm_bytes_z3", gather and gather / ring)
    copies = [f for f in probe.of_kind("copy") if f.variant.startswith("pinned")] or list(probe.of_kind("copy"))
    if copies:
        take("pcie_bytes", sum(f.median_s for f in copies) / sum(f.work for f in copies))
    adam = probe.find("host_adam")
    take("host_params", adam and adam.seconds_per_unit)
    nvme = probe.of_kind("nvme_write") + probe.of_kind("nvme_read")
    if nvme:
        take("nvme_bytes", sum(f.median_s for f in nvme) / sum(f.work for f in nvme))
    memory = probe.find("memory")
    take("dequant_bytes", memory and memory.seconds_per_unit)
    timed = {f.precision for f in probe.of_kind("engine_micro")}
    # the plan's engine precision (probe_plan: the space's 16-bit one, else fp32): the one recomputation was timed in
    checkpointed = [f.precision for f in probe.of_kind("engine_micro") if " ckpt=" in f.variant]
    main = next(iter(checkpointed), next((p.value for p in (Precision.BF16, Precision.FP16, Precision.FP32)
                                          if p.value in timed), ""))
    shares: list[tuple[int, float]] = []
    others: list[tuple[str, int, float, float]] = []
    micro_s: dict[int, float] = {}
    for stage in ZeroStage:
        micro, step = (engine_figure(probe, kind, variant=f"z{int(stage)}", precision=main)
                       for kind in ("engine_micro", "engine_step"))
        if micro is None:
            continue
        take(f"micro_steps_z{int(stage)}", micro.median_s)
        micro_s[int(stage)] = micro.median_s
        if step is not None:
            shares.append((int(stage), max(0.0, step.median_s - micro.median_s) / micro.median_s))
        for precision in sorted(timed - {main}):  # the same stage in another precision: a factor of it
            other, other_step = (engine_figure(probe, kind, variant=f"z{int(stage)}", precision=precision)
                                 for kind in ("engine_micro", "engine_step"))
            if other is not None:
                share = max(0.0, other_step.median_s - other.median_s) / other.median_s if other_step else 0.0
                others.append((precision, int(stage), other.median_s / micro.median_s, share))
    others += borrowed_factors(others, stages=sorted(micro_s), shares=dict(shares))
    recompute: list[tuple[int, float]] = []
    for figure in probe.of_kind("engine_micro"):  # "z0 ckpt=full": the lowest stage with every block recomputed
        stage, _, checkpointed = figure.variant.partition(" ckpt=")
        plain = micro_s.get(int(stage[1:])) if checkpointed == "full" and figure.precision == main else None
        if plain:
            extra = max(0.0, figure.median_s - plain)
            recompute = [(z, extra / per_micro) for z, per_micro in micro_s.items()]
    whole = pass_factors(probe, seconds=seconds, flop_factors=factors, half=half.value)
    if whole:  # named beside the figures it scales: "flops_16bit, …, model pass"
        probed.append("model pass")
    if not probed:
        return rates
    kept = [n for n, v in zip(FEATURES, seconds, strict=True) if n not in probed and v is not None]
    source = f"probe {probe.measured_at[:16]} ({', '.join(probed)})"
    if kept:
        source += f"; {rates.source} ({', '.join(kept)})"
    return Rates(seconds_per=tuple(seconds), source=source, overlap_z3=rates.overlap_z3,
                 flop_factors=tuple(sorted(factors)), step_shares=tuple(shares), recompute_shares=tuple(recompute),
                 engine_factors=tuple(others), pass_factors=whole)


def priced(figure: ProbeFigure, *, seconds: list[float | None], flop_factors: list[tuple[str, int, float]],
           half: str) -> float | None:
    """Seconds ``seconds`` (the probe's, in :data:`FEATURES` order) give a pass's work (its terms that are features:
    its FLOPs at its micro-batch's factor of ``flop_factors``, 1 for the intercept), or None where one is unpriced."""
    shape = {(p, b): f for p, b, f in flop_factors}
    total = 0.0
    for name, amount in figure.terms:
        if name not in FEATURES:
            continue
        per = seconds[FEATURES.index(name)]
        if per is None:
            return None
        of = {"flops_fp32": Precision.FP32.value, "flops_16bit": half}.get(name)
        total += amount * per * (shape.get((of, figure.micro_batch), 1.0) if of else 1.0)
    return total


def pass_factors(probe: MachineProbe, *, seconds: list[float | None], flop_factors: list[tuple[str, int, float]],
                 half: str) -> tuple[tuple[str, int, float], ...]:
    """(precision, micro-batch, factor) of each timed pass (:mod:`optimizer.perf.model_pass`): k = (t̂ − t̂₀) / (p − p₀)
    between the pass at that micro-batch and the precision's intercept, p the seconds :func:`priced` gives a pass's
    work and t̂ the fit t = a + p + c·F of every pass of the precision, the intercept's included (least squares in
    a, a call's cost, and c, the seconds per FLOP the pass runs beyond its GEMMs — its per-token work, F ∝ tokens):
    k = 1 + c·(F − F₀) / (p − p₀). The fit keeps the factor's shape over the micro-batches, which the GEMMs' own
    (their rate grows with the micro-batch, the per-token work's does not: fp32 factors 1.03 / 1.12 / 1.18 at
    micro-batch 1 / 2 / 4 on grid-llama-cpu), and drops the noise of a slope between two timings of a few ms each:
    taken pass by pass, t − t₀ over p − p₀, grid-llama-cpu's fp32 factor at micro-batch 1 read 0.77–1.40 on eight
    probes of one evening, and one of them priced its best candidate 13th (docs/benchmarks.md, "The probe's cost,
    cut"). A precision without an intercept, a work no figure prices, or a fit that gives any of its micro-batches
    a factor that is not positive (its passes do not grow with their work: timings of a loaded machine) gives no
    factor: the GEMM figures stand alone there."""
    out: list[tuple[str, int, float]] = []
    for precision in sorted({f.precision for f in probe.of_kind("pass")}):
        intercept = probe.find("pass", precision=precision, variant=PASS_INTERCEPT)
        timed = [(f, priced(f, seconds=seconds, flop_factors=flop_factors, half=half))
                 for f in probe.of_kind("pass") if f.precision == precision]
        points = [(f.work, p, f.median_s) for f, p in timed if p is not None]
        p0 = next((p for f, p in timed if f is intercept), None)
        if intercept is None or p0 is None or len(points) < 2:
            continue
        mean_f = sum(f for f, _, _ in points) / len(points)
        mean_y = sum(t - p for _, p, t in points) / len(points)
        spread = sum((f - mean_f) ** 2 for f, _, _ in points)
        if spread <= 0:
            continue
        extra = sum((f - mean_f) * (t - p - mean_y) for f, p, t in points) / spread  # c: seconds per FLOP
        fitted = [(figure.micro_batch, 1 + extra * (figure.work - intercept.work) / (p - p0))
                  for figure, p in timed if not figure.variant and p is not None and p > p0]
        if all(k > 0 for _, k in fitted):  # else the fit says a pass does not grow with its work: noise, no factor
            out += [(precision, micro_batch, k) for micro_batch, k in fitted]
    return tuple(sorted(out))


def borrowed_factors(others: list[tuple[str, int, float, float]], *, stages: list[int],
                     shares: dict[int, float]) -> list[tuple[str, int, float, float]]:
    """For a precision whose engine was timed at some stages only (:attr:`optimizer.perf.probe_plan.ProbePlan
    .engine_other_stages`: ZeRO-0 and the lowest sharded stage), each other sharded stage's (precision, stage, factor,
    share): the factor of the nearest sharded stage below it that was timed in that precision — ZeRO-1 and ZeRO-2 are
    one optimizer class (``runtime/zero/stage_1_and_2.py``), and ZeRO 1–3 all keep fp32 master weights and cast in 16
    bits, so the precision's cost relative to the 16-bit engine carries over; ZeRO-0 (the bare optimizer in fp32)
    lends to none — and the share of the stage's own optimizer step (``shares``, the 16-bit engine's: ZeRO-1 reduces
    and gathers once per step, ZeRO-2 every micro-step; which collectives a step makes is the stage's, not the
    precision's)."""
    out = []
    for precision in sorted({p for p, _, _, _ in others}):
        own = {stage: factor for p, stage, factor, _ in others if p == precision}
        for stage in stages:
            below = [s for s in own if 1 <= s < stage]
            if stage not in own and below:
                out.append((precision, stage, own[max(below)], shares.get(stage, 0.0)))
    return out


def engine_figure(probe: MachineProbe, kind: str, *, variant: str, precision: str) -> ProbeFigure | None:
    """The engine figure of that kind, variant and precision (a probe taken before the engine was timed in each
    precision has one precision: its figures stand for every precision)."""
    figures = [f for f in probe.of_kind(kind) if f.variant == variant]
    return next((f for f in figures if f.precision == precision), None)
