"""The probe's model pass (optimizer/perf/model_pass.py): the shorter model it times, the time model's count of its
work, the factor the time model reads from its timings (optimizer/perf/probed_rates.py ``pass_factors``) and how that
factor scales a candidate's compute, in prediction and in calibration (pure: the timings here are written by hand to
check the arithmetic; tests/real/deepspeed/test_probe_real.py times real passes)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from optimizer.perf.calibration import TimeSample, fit_rates
from optimizer.perf.model_pass import depth_model, pass_terms
from optimizer.perf.probe_plan import PASS_LAYERS, probe_plan
from optimizer.perf.rates import COMPUTE_FEATURES, FEATURES, Rates
from optimizer.perf.throughput import predict, profile_rates, work
from optimizer.study.knobs import Precision, with_knobs
from optimizer.study.machine_probe import PASS_INTERCEPT, MachineProbe, ProbeFigure
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]


def figure(kind: str, seconds: float, work_: float, **kw) -> ProbeFigure:
    return ProbeFigure(kind=kind, work=work_, median_s=seconds, low_s=seconds, high_s=seconds, repeats=3, **kw)


def test_the_shorter_model_keeps_the_width_and_cuts_every_per_layer_entry():
    study = load_study(ROOT / "studies" / "grid-qwen2-cpu.yaml")
    model = study.model
    config = json.loads(model.hf_config)
    config["layer_types"] = ["full_attention"] * model.layers  # transformers builds per-layer lists of that length
    config["text_config"] = {"num_hidden_layers": model.layers, "activation_sparsity_pattern": [0.95] * model.layers}
    long = replace(model, hf_config=json.dumps(config))
    short = depth_model(long, 1)
    cut = json.loads(short.hf_config)
    assert short.layers == 1 and cut["num_hidden_layers"] == 1 and cut["text_config"]["num_hidden_layers"] == 1
    assert cut["layer_types"] == ["full_attention"] and cut["text_config"]["activation_sparsity_pattern"] == [0.95]
    assert (short.hidden_size, short.ffn_size, short.vocab_size, cut["hidden_size"]) == (
        model.hidden_size, model.ffn_size, model.vocab_size, config["hidden_size"])
    assert short.inventory is None  # the whole model's: traced again for the shorter one


def test_the_plan_times_at_most_two_blocks_and_none_of_a_models_own_code():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    assert probe_plan(study).pass_layers == min(study.model.layers, PASS_LAYERS)
    deep = replace(study, model=replace(study.model, layers=80))
    assert probe_plan(deep).pass_layers == PASS_LAYERS
    own = replace(study, model=replace(study.model, entry_point="my_model:build"))
    assert probe_plan(own).pass_layers == 0


def test_pass_terms_are_one_micro_step_of_the_time_models_compute_without_the_reference():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    counted: dict[str, float] = {}
    for checkpointing in ("none", "full"):
        candidate = with_knobs(baseline_candidate(study.training), dict(precision="bf16", checkpointing=checkpointing))
        terms = dict(pass_terms(candidate=candidate, model=study.model, hardware=study.hardware,
                                training=study.training, micro_batch=2, tokens=study.training.sequence_length))
        job = work(candidate=replace(candidate, micro_batch_size=2), model=study.model, hardware=study.hardware,
                   training=study.training)
        assert terms == {"flops_16bit": pytest.approx(job.flops / job.micro_steps)}  # bf16: no fp32 FLOPs, no 4 bits
        referenced = replace(study.model, reference_model=True)  # the pass runs the trained model alone
        assert dict(pass_terms(candidate=candidate, model=referenced, hardware=study.hardware,
                               training=study.training, micro_batch=2, tokens=study.training.sequence_length)) == terms
        counted[checkpointing] = terms["flops_16bit"]
    assert counted["full"] > counted["none"]  # the blocks' forward once more


def pass_probe(*, t2: float, t4: float, t0: float, precision: str = "bf16") -> MachineProbe:
    """GEMMs at 1 ns per FLOP (mbs 4: the reference) and 1.25 ns at mbs 2; passes of 1e7 and 2e7 FLOPs, an intercept of
    1e6."""
    feature = "flops_fp32" if precision == "fp32" else "flops_16bit"
    return MachineProbe(machine="m", measured_at="2026-12-07T00:00:00+00:00", ranks=2, seconds=1.0, figures=(
        figure("gemm", 2.5e-3, 2e6, precision=precision, micro_batch=2),
        figure("attention", 2.5e-4, 2e5, precision=precision, micro_batch=2),
        figure("gemm", 4e-3, 4e6, precision=precision, micro_batch=4),
        figure("attention", 4e-4, 4e5, precision=precision, micro_batch=4),
        figure("pass", t2, 1e7, precision=precision, micro_batch=2, terms=((feature, 1e7),)),
        figure("pass", t4, 2e7, precision=precision, micro_batch=4, terms=((feature, 2e7),)),
        figure("pass", t0, 1e6, precision=precision, variant=PASS_INTERCEPT, terms=((feature, 1e6),))))


def test_a_pass_factor_is_the_fitted_per_flop_extra_over_its_gemms():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")

    def factors(probe: MachineProbe) -> dict[tuple[str, int], float]:
        return {(p, b): f for p, b, f in profile_rates(hardware=replace(study.hardware, probe=probe)).pass_factors}

    # priced: mbs 2 1e7·1.25 ns = 12.5 ms, mbs 4 20 ms; the intercept 1e6·1 ns = 1 ms (no factor of its own). Passes
    # timed as t = 2 ms + p + 0.5 ns per FLOP: the fit finds c = 0.5 ns, k = 1 + c·(F − F₀)/(p − p₀)
    exact = pass_probe(t2=0.002 + 0.0125 + 0.005, t4=0.002 + 0.020 + 0.010, t0=0.002 + 0.001 + 0.0005)
    assert factors(exact) == {("bf16", 2): pytest.approx(1 + 0.5e-9 * 9e6 / 0.0115),
                              ("bf16", 4): pytest.approx(1 + 0.5e-9 * 1.9e7 / 0.019)}
    assert MachineProbe.from_json(exact.to_json()) == exact  # the terms travel with the figure
    # 2 ms of noise on the narrow pass moves its factor less than a slope between it and the intercept would
    noisy = pass_probe(t2=0.002 + 0.0125 + 0.005 + 0.002, t4=0.002 + 0.020 + 0.010, t0=0.002 + 0.001 + 0.0005)
    two_point = 0.002 / 0.0115  # (t − t₀)/(p − p₀) taken pass by pass: 0.17 more
    assert abs(factors(noisy)[("bf16", 2)] - factors(exact)[("bf16", 2)]) < two_point / 10
    assert factors(noisy) != factors(exact)  # the noise is in the fit, spread over the passes
    # no intercept, or passes that run faster than their GEMMs would (k <= 0): no factor (the GEMMs stand alone)
    alone = replace(exact, figures=tuple(f for f in exact.figures if f.variant != PASS_INTERCEPT))
    assert factors(alone) == {}
    assert factors(pass_probe(t2=0.010 + 0.0125 - 0.013, t4=0.010 + 0.020 - 0.026, t0=0.010 + 0.001 - 0.0013)) == {}
    # one micro-batch's factor not positive (here the wide one: k4 = 1 - 1.1·19/19 < 0 < k2 = 1 - 1.1·9/11.5): the
    # precision has none, not a factor at the narrow one alone
    assert factors(pass_probe(t2=0.010 + 0.0125 - 0.011, t4=0.010 + 0.020 - 0.022, t0=0.010 + 0.001 - 0.0011)) == {}


def test_the_factor_scales_the_compute_of_its_precision_and_micro_batch_alone():
    seconds = tuple(1e-9 if name in COMPUTE_FEATURES else 1e-3 for name in FEATURES)
    plain = Rates(seconds_per=seconds, source="test")
    scaled = replace(plain, pass_factors=(("bf16", 2, 1.5),))
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    base = baseline_candidate(study.training)
    for knobs, factor in ((dict(precision="bf16", micro_batch_size=2), 1.5),
                          (dict(precision="bf16", micro_batch_size=4), 1.0),
                          (dict(precision="fp32", micro_batch_size=2), 1.0)):
        job = work(candidate=with_knobs(base, knobs), model=study.model, hardware=study.hardware,
                   training=study.training)
        before, after = plain.features(job), scaled.features(job)
        for name, a, b in zip(FEATURES, before, after, strict=True):
            assert b == pytest.approx(a * (factor if name in ("flops_fp32", "flops_16bit") else 1.0))
        one, other = (predict(job=job, rates=r, ranks=2) for r in (plain, scaled))
        assert dict(other.terms_s)["compute"] == pytest.approx(dict(one.terms_s)["compute"] * factor)
        assert dict(other.terms_s)["overhead"] == pytest.approx(dict(one.terms_s)["overhead"])


def test_calibration_keeps_the_pass_factors_as_a_shape():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    prior = profile_rates(hardware=replace(study.hardware, probe=pass_probe(t2=0.0265, t4=0.041, t0=0.0025)))
    base = baseline_candidate(study.training)
    jobs = [work(candidate=with_knobs(base, dict(precision=p, micro_batch_size=b)), model=study.model,
                 hardware=study.hardware, training=study.training) for p in ("bf16", "fp32") for b in (2, 4)]
    samples = [TimeSample(work=job, step_time_s=0.05 * (i + 1)) for i, job in enumerate(jobs)]
    fitted = fit_rates(samples, prior=prior)
    assert fitted.pass_factors == prior.pass_factors != ()
    assert Precision.BF16.value in {p for p, _, _ in fitted.pass_factors}
