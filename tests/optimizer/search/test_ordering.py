"""Ordering and calibrated pruning (optimizer/search/ordering.py, optimizer/search.next_candidate) on synthetic trials.

Every expected order below is written out by hand, with the reason in a comment — never rebuilt with the
ordering helpers under test.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import yaml

from optimizer.ledger.core import evaluate
from optimizer.perf.throughput import StepTime
from optimizer.search.launch_policy import Standing, assess
from optimizer.search.next_launch import next_candidate
from optimizer.search.ordering import memory_group, predicted_speed, study_models
from optimizer.search.space import branches, distribution_params
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]
TrialState = optuna.trial.TrialState


def _verdicts(spec):
    return [v for v in (evaluate(candidate=c, model=spec.model, hardware=spec.hardware, training=spec.training)
                        for c in spec.search_space.candidates(baseline_candidate(spec.training)))
            if v.ledger is not None]


def _by_label(spec):
    return {v.candidate.label(): v for v in _verdicts(spec)}


def _measured(spec, verdict, *, number, peak, step_time_s, state=TrialState.COMPLETE):
    ledger = verdict.ledger
    return optuna.trial.create_trial(
        state=state, values=[float(peak), 1000.0] if state is TrialState.COMPLETE else None,
        user_attrs={"candidate": verdict.candidate.knobs(), "label": verdict.candidate.label(),
                    "peak_memory_bytes": peak, "predicted_host_bytes": 0, "step_time_s": step_time_s,
                    "predicted_gpu_needed_bytes": ledger.gpu_needed_bytes, "loss_fidelity": 0.0,
                    "tokens_per_s": 1000.0})


def _small_study(folder: Path, source: str, knobs: dict, **hardware):
    raw = yaml.safe_load((ROOT / "studies" / source).read_text())
    raw["search_space"] = {"knobs": knobs}
    raw["hardware"].update(hardware)
    path = folder / source
    path.write_text(yaml.safe_dump(raw))
    return load_study(path)


def _launch_order(spec) -> list[str]:
    """The labels next_candidate picks one after another, each marked measured before the next pick (the
    models stay the uncalibrated ones, so only the order rule is exercised)."""
    verdicts = _verdicts(spec)
    base = baseline_candidate(spec.training)
    models = study_models(spec=spec, trials=[], base=base)
    trials, order = [], []
    while (choice := next_candidate(spec=spec, space=branches(spec), trials=trials, models=models,
                                    verdicts=verdicts)) is not None:
        order.append(choice.label())
        trials.append(optuna.trial.create_trial(state=TrialState.COMPLETE, values=[1.0, 1.0],
                                                user_attrs={"label": choice.label(),
                                                            "loss_fidelity": 0.0}))
    return order


# grid-cpu's tiny GPT on 2 CPU ranks with a 1 GB budget (everything fits); CPU ranks have no profile figures,
# so the order is optimizer.search.next_launch.promise's documented rule: no offload first, then no recomputation, then
# the lower ZeRO stage, then 16-bit before fp32, then the larger micro-batch.
PROMISE_KNOBS = {"zero_stage": [0, 1], "offload_optimizer": ["none", "cpu"], "precision": ["fp32", "bf16"],
                 "micro_batch_size": [1, 2]}
PROMISE_ORDER = [
    "z0 bf16 ckpt=none mbs=2", "z0 bf16 ckpt=none mbs=1", "z0 fp32 ckpt=none mbs=2", "z0 fp32 ckpt=none mbs=1",
    "z1 bf16 ckpt=none mbs=2", "z1 bf16 ckpt=none mbs=1", "z1 fp32 ckpt=none mbs=2", "z1 fp32 ckpt=none mbs=1",
    # offload last (ZeRO-0 cannot offload: DeepSpeed needs stage >= 1)
    "z1 bf16 ckpt=none mbs=2 opt->cpu", "z1 bf16 ckpt=none mbs=1 opt->cpu",
    "z1 fp32 ckpt=none mbs=2 opt->cpu", "z1 fp32 ckpt=none mbs=1 opt->cpu",
]


def test_without_figures_the_order_is_the_promise_order(tmp_path):
    spec = _small_study(tmp_path, "grid-cpu.yaml", PROMISE_KNOBS, gpu_memory="1 GB")
    assert _launch_order(spec) == PROMISE_ORDER


def test_without_figures_offload_comes_after_recomputation(tmp_path):
    # promise ranks the number of offloads before recomputation: full checkpointing without offload first.
    spec = _small_study(tmp_path, "grid-cpu.yaml", {"zero_stage": [1], "offload_optimizer": ["none", "cpu"],
                                                    "precision": ["bf16"], "checkpointing": ["none", "full"],
                                                    "micro_batch_size": [2]}, gpu_memory="1 GB")
    assert _launch_order(spec) == ["z1 bf16 ckpt=none mbs=2", "z1 bf16 ckpt=full mbs=2",
                                   "z1 bf16 ckpt=none mbs=2 opt->cpu", "z1 bf16 ckpt=full mbs=2 opt->cpu"]


def test_with_a_profile_the_order_is_predicted_throughput(tmp_path):
    # Llama-2-7B (Ψ = 6,738,415,616) on 8 H100 (profile: link 450 GB/s per direction, PCIe 64 GB/s, CPU Adam
    # 7e8 params/s), global batch 256 → M = 256 / (mbs·8) micro-steps: 32 at mbs 1, 16 at mbs 2. The compute is
    # the same for all eight (same tokens, same full recomputation), so the exposed time beyond it decides.
    # One ring pass of the bf16 gradients: 7/8 · Ψ · 2 B = 11.79 GB → 0.0262 s.
    #   ZeRO-1: all-reduce once per step, 2 passes = 0.052 s, whatever the micro-batch (a tie, broken by the
    #   promise order: the larger micro-batch first);
    #   ZeRO-2: reduce-scatter every micro-step + one all-gather, M + 1 passes: mbs 2 → 17 = 0.446 s,
    #   mbs 1 → 33 = 0.865 s;
    #   optimizer offload adds PCIe 2 · Ψ/8 · 2 B / 64 GB/s = 0.053 s and CPU Adam Ψ/8 / 7e8 = 1.203 s:
    #   ZeRO-1 1.308 s (tie again), ZeRO-2 mbs 2 1.70 s, mbs 1 2.12 s.
    spec = _small_study(tmp_path, "llama-7b-8xh100.yaml",
                        {"zero_stage": [1, 2], "offload_optimizer": ["none", "cpu"], "precision": ["bf16"],
                         "checkpointing": ["full"], "micro_batch_size": [1, 2]})
    assert _launch_order(spec) == [
        "z1 bf16 ckpt=full mbs=2", "z1 bf16 ckpt=full mbs=1", "z2 bf16 ckpt=full mbs=2", "z2 bf16 ckpt=full mbs=1",
        "z1 bf16 ckpt=full mbs=2 opt->cpu", "z1 bf16 ckpt=full mbs=1 opt->cpu",
        "z2 bf16 ckpt=full mbs=2 opt->cpu", "z2 bf16 ckpt=full mbs=1 opt->cpu",
    ]


def test_measured_running_queued_and_failed_candidates(tmp_path):
    spec = _small_study(tmp_path, "grid-cpu.yaml", PROMISE_KNOBS, gpu_memory="1 GB")
    verdicts = _verdicts(spec)
    by_label = {v.candidate.label(): v for v in verdicts}
    space = branches(spec)
    models = study_models(spec=spec, trials=[], base=baseline_candidate(spec.training))

    def pick(trials):
        return next_candidate(spec=spec, space=space, trials=trials, models=models, verdicts=verdicts).label()

    first, second, third, fourth, fifth = PROMISE_ORDER[:5]
    assert pick([]) == first
    done = _measured(spec, by_label[first], number=0, peak=1, step_time_s=0.1)
    assert pick([done]) == second
    running = optuna.trial.create_trial(state=TrialState.RUNNING,
                                        user_attrs={"label": by_label[second].candidate.label()})
    assert pick([done, running]) == third
    params = distribution_params(by_label[third].candidate, space)
    queued = optuna.trial.create_trial(state=TrialState.WAITING, params=params, distributions={
        name: optuna.distributions.CategoricalDistribution([value]) for name, value in params.items()})
    assert pick([done, running, queued]) == fourth
    oom = optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={
        "label": by_label[fourth].candidate.label(), "outcome": "oom"})
    assert pick([done, running, queued, oom]) == fifth  # a classified failure is final
    died = optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={
        "label": by_label[fourth].candidate.label()})
    assert pick([done, running, queued, died]) == fourth  # its worker died: not a result, offered again


@pytest.fixture(scope="module")
def grid():
    return load_study(ROOT / "studies" / "grid-cpu.yaml")


def test_calibrated_memory_never_prunes_a_measured_fit(grid):
    # One group (ZeRO-0 fp32, no checkpointing, no offload: the three micro-batches), budget 3,000,000 B, with
    # hand-picked figures (measured / predicted):
    #   mbs 1: 2,800,000 / 2,000,000 = 1.4, fits (2.8 MB <= 3 MB): caps the factor at 3.0 / 2.0 = 1.5;
    #   mbs 2: over the budget (outcome oom), 3,500,000 / 2,500,000 = 1.4, no cap;
    #   mbs 4: 3,000,000 / 2,500,000 = 1.2, fits exactly: caps the factor at 3.0 / 2.5 = 1.2.
    # Median ratio 1.4, lowered to the smallest cap: 1.2 (optimizer.perf.calibration module doc).
    by_label = _by_label(grid)
    fit, over, tight = (by_label[f"z0 fp32 ckpt=none mbs={m}"] for m in (1, 2, 4))
    group = memory_group(tight.candidate)
    assert {memory_group(v.candidate) for v in (fit, over)} == {group}

    def trial(verdict, *, predicted, device, state=TrialState.COMPLETE):
        attrs = {"candidate": verdict.candidate.knobs(), "label": verdict.candidate.label(),
                 "predicted_gpu_needed_bytes": predicted, "device_share_bytes": device, "step_time_s": 0.1,
                 "loss_fidelity": 0.0}
        if state is TrialState.FAIL:
            attrs["outcome"] = "oom"
        return optuna.trial.create_trial(state=state, values=[float(device), 1000.0]
                                         if state is TrialState.COMPLETE else None, user_attrs=attrs)

    trials = [trial(fit, predicted=2_000_000, device=2_800_000),
              trial(over, predicted=2_500_000, device=3_500_000, state=TrialState.FAIL),
              trial(tight, predicted=2_500_000, device=3_000_000)]
    models = study_models(spec=grid, trials=trials, base=baseline_candidate(grid.training))
    assert models.memory_factor(tight.candidate) == pytest.approx(1.2)
    other = by_label["z1 bf16 ckpt=full mbs=1"]
    assert models.memory_factor(other.candidate) == 1.0  # nothing of its group measured
    assert models.measured_fits == {fit.candidate.label(), tight.candidate.label()}
    budget = grid.hardware.gpu_memory_bytes
    assert budget == 3_000_000
    huge = replace(models, memory_factors=((group, 10.0),))
    for verdict in (fit, tight):  # measured to fit: kept whatever the factor
        assert assess(verdict, models=huge).standing is Standing.MEASURED
    assert assess(over, models=huge).standing is Standing.PRUNED  # x10 its need: no chance to fit


def test_time_calibration_reproduces_its_measurements_and_leaves_the_rest_unknown(grid):
    # Step times measured on 2 CPU ranks (benchmarks/data/grid-cpu.json, fp32, no checkpointing, mbs 2).
    measured = {"z0 fp32 ckpt=none mbs=2": 0.022986840000157827, "z1 fp32 ckpt=none mbs=2": 0.06531726599860121,
                "z2 fp32 ckpt=none mbs=2": 0.10596833099953074}
    by_label = _by_label(grid)
    base = baseline_candidate(grid.training)
    trials = [_measured(grid, by_label[label], number=i, peak=1, step_time_s=t)
              for i, (label, t) in enumerate(measured.items())]
    assert study_models(spec=grid, trials=trials[:2], base=base).rates.source == "no hardware.profile"
    models = study_models(spec=grid, trials=trials, base=base)
    assert models.rates.source == "calibrated on 3 trial(s)"
    for label, step_time_s in measured.items():  # three trials, more unknowns than that: fitted closely
        speed = predicted_speed(by_label[label].candidate, spec=grid, models=models)
        assert isinstance(speed, StepTime)
        assert speed.total_s == pytest.approx(step_time_s, rel=1e-3)
        assert speed.tokens_per_s == pytest.approx(8 * 64 / step_time_s, rel=1e-3)  # global batch 8 x 64 tokens
    # No trial ran ZeRO-3 or 16-bit: their figures stay unknown rather than guessed.
    for label in ("z3 fp32 ckpt=none mbs=2", "z1 bf16 ckpt=none mbs=2"):
        assert predicted_speed(by_label[label].candidate, spec=grid, models=models).startswith("unknown")
