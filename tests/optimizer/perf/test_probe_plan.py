"""What the probe times for a study, and how the time model reads a probe (pure; no probe is run here — the figures
below are written by hand to check the arithmetic; tests/real/deepspeed/test_probe_real.py runs real ones)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from optimizer.perf.calibration import TimeSample, fit_rates
from optimizer.perf.probe_plan import (
    MAX_ELEMENTS_CPU,
    WIDE_BYTES,
    WIDE_BYTES_CPU,
    distinct_sizes,
    gemm_shapes,
    probe_plan,
)
from optimizer.perf.throughput import FEATURES, Rates, predict, profile_rates, work
from optimizer.study.hardware_profiles import profile_named
from optimizer.study.knobs import NoCheckpointing, Precision, ZeroStage, with_knobs
from optimizer.study.machine_probe import MachineProbe, ProbeFigure
from optimizer.study.specs import HardwareSpec, MlpKind, TransformerModel, baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]


def figure(kind: str, seconds: float, work_: float, **kw) -> ProbeFigure:
    return ProbeFigure(kind=kind, work=work_, median_s=seconds, low_s=seconds * 0.9, high_s=seconds * 1.2, repeats=5,
                       **kw)


def test_gemm_shapes_are_the_models_weights():
    # Llama-2-7B's shape: per block q, o 4096², k, v 4096·4096 (no GQA), gate, up 4096·11008, down 11008·4096;
    # head 4096·32000: 6,476,005,376 + 131,072,000 weight elements (Hugging Face's 6,738,415,616 less the
    # embedding's 131,072,000 and the 2·32·4096 + 4096 RMSNorm weights).
    model = TransformerModel(layers=32, hidden_size=4096, heads=32, kv_heads=32, ffn_size=11008, vocab_size=32000,
                             mlp=MlpKind.SWIGLU, tied_embeddings=False)
    shapes = gemm_shapes(model)
    assert sum(i * o * n for i, o, n in shapes) == 6_738_415_616 - 131_072_000 - (2 * 32 + 1) * 4096
    assert dict(((i, o), n) for i, o, n in shapes)[(4096, 11008)] == 64  # gate and up per block


def test_plan_follows_the_space():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    plan = probe_plan(study)
    assert plan.precisions == ("fp32", "bf16") and plan.micro_batches == (1, 2, 4)
    assert plan.ranks == 2 and plan.accelerator == "cpu" and plan.eager_attention  # grid-cpu: attention: eager
    assert plan.host_adam_elements > 0 and plan.copy_bytes > 0  # offload_optimizer: [none, cpu]
    assert len(plan.reduce_bytes) == 2  # the gradient bucket and a wide one (β: the slope between them)
    assert plan.scatter_bytes == (min(plan.reduce_bytes),)  # the bucket: the time model reads no reduce-scatter β
    assert len(plan.gather_bytes) == 2  # ZeRO-3's prefetch bucket (ZeRO-1/2's within 2× of it), a wide one
    assert plan.nvme_path is None and plan.memory_bytes == 0
    narrow = replace(study, search_space=replace(study.search_space, values=(
        ("zero_stage", (ZeroStage.DISABLED,)), ("precision", (Precision.FP32,)))))
    plan = probe_plan(narrow)
    assert plan.precisions == ("fp32",) and plan.micro_batches == (study.training.micro_batch_size,)
    assert plan.host_adam_elements == 0 and plan.copy_bytes == 0 and plan.gather_bytes == ()
    one = replace(narrow, hardware=replace(narrow.hardware, gpus_per_node=1))
    assert probe_plan(one).reduce_bytes == () == probe_plan(one).gather_bytes  # one rank: no collective to time
    assert probe_plan(study).device_adam_elements <= MAX_ELEMENTS_CPU


def test_collective_sizes_within_twice_of_each_other_are_timed_once():
    assert distinct_sizes([8192, 4 << 20, 7372]) == (7372, 4 << 20)
    assert distinct_sizes([100, 200, 201, 401, 402, 403]) == (100, 201, 403)  # each against the last one kept
    assert distinct_sizes([3 << 20, 4 << 20]) == (3 << 20, 4 << 20)  # the smallest and the widest: always (β)
    assert distinct_sizes([5, 5]) == (5,) and distinct_sizes([]) == ()


def test_the_wide_collective_is_narrower_on_cpu_ranks():
    cpu = load_study(ROOT / "studies" / "grid-cpu.yaml")
    assert max(probe_plan(cpu).reduce_bytes) == WIDE_BYTES_CPU == max(probe_plan(cpu).gather_bytes)
    gpus = load_study(ROOT / "studies" / "llama-7b-8xh100.yaml")
    assert gpus.hardware.accelerator.value == "cuda"
    assert max(probe_plan(gpus).reduce_bytes) >= WIDE_BYTES and WIDE_BYTES in probe_plan(gpus).gather_bytes
    assert WIDE_BYTES_CPU < WIDE_BYTES


def test_plan_counts_flops_as_the_time_model_does():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    plan = probe_plan(study)
    candidate = with_knobs(baseline_candidate(study.training), dict(zero_stage=0, precision="fp32",
                           checkpointing="none", micro_batch_size=2, offload_optimizer="none"))
    job = work(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)
    per_micro_step = job.flops / job.micro_steps
    # the time model counts biases and norms as 2 FLOPs per element too (Kaplan's 2·N); the GEMMs are the rest
    assert plan.gemm_flops(2) + plan.attention_flops(2) == pytest.approx(per_micro_step, rel=0.02)
    assert plan.gemm_flops(4) == 2 * plan.gemm_flops(2)


def test_probe_json_round_trip_and_refusals():
    probe = MachineProbe(machine="m", measured_at="2026-12-06T00:00:00+00:00", ranks=2, seconds=1.0,
                         figures=(figure("gemm", 1e-3, 1e9, precision="bf16", micro_batch=2),),
                         skipped=(("host_adam", "not built"),))
    assert MachineProbe.from_json(probe.to_json()) == probe
    with pytest.raises(ValueError, match="format"):
        MachineProbe.from_json({**probe.to_json(), "format": 0})
    with pytest.raises(ValueError, match="kind"):
        figure("gemv", 1e-3, 1.0)
    with pytest.raises(ValueError, match="low <= median"):
        ProbeFigure(kind="copy", work=1.0, median_s=1.0, low_s=2.0, high_s=3.0, repeats=1)


def two_rank_probe() -> MachineProbe:
    return MachineProbe(machine="m", measured_at="2026-12-06T00:00:00+00:00", ranks=2, seconds=1.0, figures=(
        figure("gemm", 4e-3, 1e9, precision="fp32", micro_batch=1), figure("attention", 1e-3, 1e8, precision="fp32",
                                                                         micro_batch=1),
        figure("gemm", 6e-3, 2e9, precision="fp32", micro_batch=2), figure("attention", 1.5e-3, 2e8, precision="fp32",
                                                                         micro_batch=2),
        figure("gemm", 8e-3, 4e9, precision="fp32", micro_batch=4), figure("attention", 2e-3, 4e8, precision="fp32",
                                                                         micro_batch=4),
        figure("all_reduce", 2e-3, 1e6, variant="1000000 B"), figure("all_reduce", 1.1e-3, 1e5, variant="100000 B"),
        figure("all_gather", 1e-3, 1e6, variant="1000000 B"), figure("all_gather", 5.5e-4, 1e5, variant="100000 B"),
        figure("host_adam", 1e-3, 1e6),
        figure("copy", 1e-3, 1e7, variant="pinned h2d"), figure("copy", 9e-3, 1e7, variant="pageable h2d")))


def test_probed_rates_take_each_figure_the_probe_has():
    hardware = HardwareSpec(gpus_per_node=2, gpu_memory_bytes=80 * 10**9, profile=profile_named("h100-80gb"))
    plain = profile_rates(hardware=hardware)
    rates = profile_rates(hardware=replace(hardware, probe=two_rank_probe()))
    got = dict(zip(FEATURES, rates.seconds_per, strict=True))
    assert got["flops_fp32"] == pytest.approx((6e-3 + 1.5e-3) / (2e9 + 2e8))  # the middle micro-batch: 2
    factors = {(p, b): f for p, b, f in rates.flop_factors}
    assert factors[("fp32", 4)] == pytest.approx(((8e-3 + 2e-3) / 4.4e9) / ((6e-3 + 1.5e-3) / 2.2e9))
    # β, the slope between the two sizes (the latency α = 1e-3 s is a call's, not a byte's): 0.9e-3 s / 0.9e6 B;
    # an all-reduce moves 2·(W−1)/W of its buffer per rank, an all-gather (W−1)/W
    assert got["comm_bytes"] == pytest.approx(1e-9 / (2 * 0.5))
    assert got["comm_bytes_z3"] == pytest.approx(0.5e-9 / 0.5)
    assert got["pcie_bytes"] == pytest.approx(1e-3 / 1e7)  # pinned, as DeepSpeed's offload buffers are
    assert got["host_params"] == pytest.approx(1e-9)
    untouched = dict(zip(FEATURES, plain.seconds_per, strict=True))
    assert got["flops_16bit"] == untouched["flops_16bit"] and got["nvme_bytes"] == untouched["nvme_bytes"]
    assert rates.source.startswith("probe 2026-12-06T00:00") and "profile h100-80gb (flops_16bit" in rates.source
    two_nodes = replace(hardware, nodes=2, inter_node_bytes_per_s=25e9)  # the probe times one node's ranks only
    probed = profile_rates(hardware=replace(two_nodes, probe=two_rank_probe()))
    assert probed.seconds_per[FEATURES.index("comm_bytes")] == 1 / 25e9


def test_flop_factors_shape_prediction_and_calibration_alike():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    base = baseline_candidate(study.training)
    truth = Rates(seconds_per=(2e-11, 1e-11, 1e-7, 1e-7, 1e-10, 1e-9, None, 0.01, 0.03, 0.04, 0.05, None),
                  source="truth", overlap_z3=False, flop_factors=(("bf16", 1, 2.0), ("bf16", 4, 0.5)))
    samples = []
    for stage in (0, 1, 2, 3):
        for mbs in (1, 2, 4):
            c = with_knobs(base, dict(zero_stage=stage, precision="bf16", micro_batch_size=mbs,
                                      offload_optimizer="none"))
            job = work(candidate=c, model=study.model, hardware=study.hardware, training=study.training)
            samples.append(TimeSample(work=job, step_time_s=predict(job=job, rates=truth, ranks=2).total_s))
    one = samples[0].work
    assert truth.features(one)[1] == 2.0 * one.vector()[1]  # bf16 at micro-batch 1: twice the seconds per FLOP
    prior = replace(truth, seconds_per=tuple(None if v is None else v * 3 for v in truth.seconds_per))
    fitted = fit_rates(samples, prior=prior)
    assert fitted.flop_factors == truth.flop_factors
    for sample in samples:  # the factors carried into the fit: every step time recovered
        assert predict(job=sample.work, rates=fitted, ranks=2).total_s == pytest.approx(sample.step_time_s, rel=0.02)


def test_the_engines_figures_are_each_stages_cost_per_micro_step_and_per_step():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    engine = (figure("engine_micro", 0.004, 1, precision="bf16", variant="z1"),
              figure("engine_step", 0.034, 1, precision="bf16", variant="z1"),
              figure("engine_micro", 0.050, 1, precision="bf16", variant="z2"),
              figure("engine_step", 0.045, 1, precision="bf16", variant="z2"))  # noise: the step no dearer
    probe = replace(two_rank_probe(), figures=two_rank_probe().figures + engine)
    rates = profile_rates(hardware=replace(study.hardware, probe=probe))
    got = dict(zip(FEATURES, rates.seconds_per, strict=True))
    assert (got["micro_steps_z1"], got["micro_steps_z2"], got["micro_steps_z0"]) == (0.004, 0.050, None)
    assert dict(rates.step_shares) == {1: pytest.approx(7.5), 2: 0.0}  # (34 − 4) / 4 micro-steps; never below 0
    assert "micro_steps_z1" in rates.source
    base = baseline_candidate(study.training)
    for stage, per_step in ((1, lambda m: 0.004 * (m + 7.5)), (2, lambda m: 0.050 * m)):
        for mbs in (1, 4):  # 4 micro-steps and 1
            c = with_knobs(base, dict(zero_stage=stage, precision="fp32", micro_batch_size=mbs,
                                      offload_optimizer="none"))
            job = work(candidate=c, model=study.model, hardware=study.hardware, training=study.training)
            overhead = dict(predict(job=job, rates=rates, ranks=2).terms_s)["overhead"]
            assert overhead == pytest.approx(per_step(job.micro_steps))
    fitted = fit_rates([TimeSample(work=job, step_time_s=1.0)], prior=rates)
    assert fitted.step_shares == rates.step_shares  # calibration scales a stage's cost, its shape stays the probe's


def test_each_precision_pays_its_own_engines_cost():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    plan = probe_plan(study)
    assert (plan.engine_precision, plan.engine_others) == ("bf16", ("fp32",))  # grid-cpu's space holds both
    engine = (figure("engine_micro", 0.004, 1, precision="bf16", variant="z1"),
              figure("engine_step", 0.034, 1, precision="bf16", variant="z1"),
              figure("engine_micro", 0.002, 1, precision="fp32", variant="z1"),
              figure("engine_step", 0.005, 1, precision="fp32", variant="z1"))
    probe = replace(two_rank_probe(), figures=two_rank_probe().figures + engine)
    rates = profile_rates(hardware=replace(study.hardware, probe=probe))
    assert dict(zip(FEATURES, rates.seconds_per, strict=True))["micro_steps_z1"] == 0.004  # the 16-bit engine's
    assert rates.engine_factors == (("fp32", 1, pytest.approx(0.5), pytest.approx(1.5)),)  # 2/4 ms; (5 − 2) / 2
    base = baseline_candidate(study.training)
    for precision, per_step in (("bf16", lambda m: 0.004 * (m + 7.5)), ("fp32", lambda m: 0.002 * m + 0.003)):
        for mbs in (1, 4):
            c = with_knobs(base, dict(zero_stage=1, precision=precision, micro_batch_size=mbs,
                                      offload_optimizer="none"))
            job = work(candidate=c, model=study.model, hardware=study.hardware, training=study.training)
            engine_s = rates.features(job)[FEATURES.index("micro_steps_z1")] * 0.004  # the stage's seconds
            assert engine_s == pytest.approx(per_step(job.micro_steps))
    fitted = fit_rates([TimeSample(work=job, step_time_s=1.0)], prior=rates)
    assert fitted.engine_factors == rates.engine_factors  # calibration scales the stage, each precision's shape stays
    old = profile_rates(hardware=replace(study.hardware, probe=replace(two_rank_probe(), figures=(
        two_rank_probe().figures + engine[:2]))))  # a probe of one precision: its figures stand for every one
    assert old.engine_factors == () and dict(old.step_shares) == {1: pytest.approx(7.5)}
    # an fp16 + fp32 space on a machine with bf16: the plan's engine precision is fp16, the one recomputation was
    # timed in, whatever the hardware supports
    fp16 = (*(replace(f, precision="fp16") for f in engine[:2]),
            figure("engine_micro", 0.002, 1, precision="fp32", variant="z1"),
            figure("engine_micro", 0.010, 1, precision="fp16", variant="z1 ckpt=full"))
    mixed = profile_rates(hardware=replace(study.hardware, probe=replace(two_rank_probe(), figures=(
        two_rank_probe().figures + fp16))))
    assert dict(zip(FEATURES, mixed.seconds_per, strict=True))["micro_steps_z1"] == 0.004
    assert mixed.engine_factors == (("fp32", 1, pytest.approx(0.5), 0.0),)  # no stepping figure: no share
    assert dict(mixed.recompute_shares) == {1: pytest.approx(1.5)}  # (10 − 4) / 4


def test_recomputation_costs_its_probed_extra_per_micro_step_in_proportion_to_the_blocks_it_recomputes():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    assert probe_plan(study).engine_recompute  # grid-cpu's space has checkpointing: full
    plain = replace(study, search_space=replace(study.search_space, values=(("checkpointing", (NoCheckpointing(),)),)))
    assert not probe_plan(plain).engine_recompute
    engine = (figure("engine_micro", 0.004, 1, precision="bf16", variant="z0"),
              figure("engine_micro", 0.050, 1, precision="bf16", variant="z2"),
              figure("engine_micro", 0.014, 1, precision="bf16", variant="z0 ckpt=full"))
    probe = replace(two_rank_probe(), figures=two_rank_probe().figures + engine)
    rates = profile_rates(hardware=replace(study.hardware, probe=probe))
    assert dict(rates.recompute_shares) == {0: pytest.approx(2.5), 2: pytest.approx(0.2)}  # 10 ms in each's units
    base = baseline_candidate(study.training)
    for stage in (0, 2):
        overhead = {}
        for checkpointing in ("none", "full", "every_2"):
            c = with_knobs(base, dict(zero_stage=stage, precision="fp32", micro_batch_size=1, offload_optimizer="none",
                                      checkpointing=checkpointing))
            job = work(candidate=c, model=study.model, hardware=study.hardware, training=study.training)
            overhead[checkpointing] = dict(predict(job=job, rates=rates, ranks=2).terms_s)["overhead"]
        # 4 micro-steps: 10 ms more each with every block recomputed, half that with every 2nd of grid-cpu's 2 blocks
        assert overhead["full"] - overhead["none"] == pytest.approx(4 * 0.010)
        assert overhead["every_2"] - overhead["none"] == pytest.approx(4 * 0.005)


def test_a_precision_timed_below_zero2_lends_zero1s_factor_to_the_stages_above():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    assert probe_plan(study).engine_other_stages == (0, 1)  # of the space's 0–3
    engine = (figure("engine_micro", 0.004, 1, precision="bf16", variant="z1"),
              figure("engine_step", 0.034, 1, precision="bf16", variant="z1"),
              figure("engine_micro", 0.050, 1, precision="bf16", variant="z2"),
              figure("engine_step", 0.060, 1, precision="bf16", variant="z2"),
              figure("engine_micro", 0.100, 1, precision="bf16", variant="z3"),
              figure("engine_micro", 0.002, 1, precision="fp32", variant="z1"),
              figure("engine_step", 0.005, 1, precision="fp32", variant="z1"))
    probe = replace(two_rank_probe(), figures=two_rank_probe().figures + engine)
    rates = profile_rates(hardware=replace(study.hardware, probe=probe))
    # ZeRO-1's fp32 factor (2/4 ms) at ZeRO-2 and 3, each with its own stage's optimizer-step share (ZeRO-2: (60 −
    # 50) / 50; ZeRO-3: no stepping figure, 0), not ZeRO-1's 1.5
    assert sorted(rates.engine_factors) == [("fp32", 1, pytest.approx(0.5), pytest.approx(1.5)),
                                            ("fp32", 2, pytest.approx(0.5), pytest.approx(0.2)),
                                            ("fp32", 3, pytest.approx(0.5), 0.0)]
    alone = replace(two_rank_probe(), figures=two_rank_probe().figures + engine[:5])  # no fp32 engine at all
    assert profile_rates(hardware=replace(study.hardware, probe=alone)).engine_factors == ()
    zero0 = (*engine[:5], figure("engine_micro", 0.004, 1, precision="bf16", variant="z0"),
             figure("engine_micro", 0.008, 1, precision="fp32", variant="z0"))  # fp32 timed at ZeRO-0 alone
    rates = profile_rates(hardware=replace(study.hardware, probe=replace(two_rank_probe(), figures=(
        two_rank_probe().figures + zero0))))
    assert [stage for _, stage, _, _ in rates.engine_factors] == [0]  # ZeRO-0's bare optimizer lends to none
