"""Unit tests of optimizer/search/calibration_report.py's ``calibration_table`` (``dsopt ledger --calibrated``).

The study is studies/cpu-tiny.yaml (2 CPU ranks, global batch 8, sequence 64, micro-batch 2: no hardware.profile,
so its profile rates are all unknown). The calibrated rates are stated here, zero for every feature but the
ZeRO-0 per-micro-step overhead, so the predicted step is worked by hand from optimizer/perf/throughput.py's
module doc: T = G·s/W = 8·64/2 = 256 tokens per rank, M = G/(mbs·W) = 8/(2·2) = 2 micro-steps, step =
M × overhead, tokens/s = T·W / step. Memory figures are stated trial attributes; MB = 10^6 bytes.
"""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from optimizer.perf.throughput import FEATURES, Rates
from optimizer.search import calibration_report
from optimizer.search.calibration_report import calibration_table
from optimizer.search.ordering import StudyModels

Z0_FP32 = {"zero_stage": 0, "offload_optimizer": "none", "offload_param": "none", "precision": "fp32",
           "checkpointing": "none", "micro_batch_size": 2}
GROUP = "z0-fp32-none-optnone-pnone"  # ordering.memory_group: stage, precision, checkpointing, offloads
HEADER = ("| trial | candidate | measured MB | ledger MB | err | calibrated MB | err | measured tokens/s | "
          "model tokens/s | err | calibrated tokens/s | err |")


def _overhead_rates(z0_micro_step_s: float, *, source: str, unknown: tuple[str, ...] = ()) -> Rates:
    """Seconds per unit: 0 for every feature except ZeRO-0's micro-step overhead; ``unknown`` ones None."""
    per = tuple(None if name in unknown else (z0_micro_step_s if name == "micro_steps_z0" else 0.0)
                for name in FEATURES)
    return Rates(seconds_per=per, source=source)


def _measured_trials() -> list[optuna.trial.FrozenTrial]:
    """Trial 0 measured (z0 fp32 mbs=2), trial 1 reused and trial 2 pruned: only trial 0 gets a row."""
    study = optuna.create_study(directions=["minimize", "maximize"])
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.COMPLETE, values=[3_000_000.0, 400.0],
        user_attrs={"candidate": Z0_FP32, "step_time_s": 1.28, "tokens_per_s": 400.0,
                    "device_share_bytes": 3_000_000, "predicted_training_needed_bytes": 2_500_000}))
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.COMPLETE, values=[3_000_000.0, 400.0],
        user_attrs={"candidate": Z0_FP32, "step_time_s": 1.28, "tokens_per_s": 400.0, "reused_from": 0}))
    study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED, user_attrs={"candidate": Z0_FP32}))
    return study.trials


def _models() -> StudyModels:
    # calibrated: 0.5 s per ZeRO-0 micro-step -> step = 2 · 0.5 = 1.0 s -> 256 · 2 / 1.0 = 512 tokens/s
    return StudyModels(rates=_overhead_rates(0.5, source="calibrated on 1 trials"),
                       memory_factors=((GROUP, 1.1),), time_samples=1, measured_fits=frozenset())


def test_the_table_without_a_hardware_profile(tiny):
    text = calibration_table(spec=tiny, trials=_measured_trials(), models=_models())
    # measured 3_000_000 B = 3.000 MB; ledger 2_500_000 B = 2.500 MB, err (2.5 - 3) / 3 = -16.67 % -> "-16.7%";
    # calibrated 1.1 · 2.5 = 2.75 MB, err (2.75 - 3) / 3 = -8.33 % -> "-8.3%"; the profile model is unknown
    # (no hardware.profile: its err is "-"); calibrated 512 tokens/s, err (512 - 400) / 400 = +28.0 %
    fitted = [f"  {name:<15}    unknown → {'5.000e-01' if name == 'micro_steps_z0' else '0.000e+00'}"
              for name in FEATURES]
    assert text.splitlines() == [
        "study cpu-tiny: 1 measured trial(s); time model calibrated on 1 trials; "
        f"memory factors by group: {GROUP} x1.100; MB = 10^6 bytes",
        "",
        HEADER,
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        "| 0 | z0 fp32 ckpt=none mbs=2 | 3.000 | 2.500 | -16.7% | 2.750 | -8.3% | 400 | unknown | - | 512 | +28.0% |",
        "",
        "fitted seconds per unit (profile → calibrated):",
        *fitted,
    ]


def test_the_fitted_lines_name_each_feature_in_order(tiny):
    lines = calibration_table(spec=tiny, trials=_measured_trials(), models=_models()).splitlines()
    names = [line.split()[0] for line in lines[lines.index("fitted seconds per unit (profile → calibrated):") + 1:]]
    assert names == ["flops_fp32", "flops_16bit", "comm_bytes", "comm_bytes_z3", "pcie_bytes", "host_params",
                     "nvme_bytes", "micro_steps_z0", "micro_steps_z1", "micro_steps_z2", "micro_steps_z3",
                     "dequant_bytes"]


def test_the_table_with_profile_rates_shows_the_models_speed_and_error(tiny, monkeypatch):
    # profile: 0.25 s per ZeRO-0 micro-step -> step = 2 · 0.25 = 0.5 s -> 256 · 2 / 0.5 = 1024 tokens/s,
    # err (1024 - 400) / 400 = +156.0 %; NVMe unknown in the profile (the candidate moves no NVMe bytes)
    prior = _overhead_rates(0.25, source="profile test", unknown=("nvme_bytes",))
    monkeypatch.setattr(calibration_report, "profile_rates", lambda *, hardware: prior)
    lines = calibration_table(spec=tiny, trials=_measured_trials(), models=_models()).splitlines()
    assert lines[4] == ("| 0 | z0 fp32 ckpt=none mbs=2 | 3.000 | 2.500 | -16.7% | 2.750 | -8.3% | 400 | 1,024 "
                        "| +156.0% | 512 | +28.0% |")
    assert lines[7] == "  flops_fp32       0.000e+00 → 0.000e+00"
    assert lines[13] == "  nvme_bytes         unknown → 0.000e+00"
    assert lines[14] == "  micro_steps_z0   2.500e-01 → 5.000e-01"


def test_a_group_without_a_factor_keeps_the_ledger_and_no_measured_speed_shows_no_error(tiny):
    trial = optuna.trial.create_trial(
        state=TrialState.COMPLETE, values=[2_000_000.0, 1.0],
        user_attrs={"candidate": {**Z0_FP32, "micro_batch_size": 4}, "step_time_s": 1.0,
                    "memory_objective_bytes": 2_200_000, "predicted_host_bytes": 200_000,
                    "predicted_training_needed_bytes": 2_500_000})
    study = optuna.create_study(directions=["minimize", "maximize"])
    study.add_trial(trial)
    models = StudyModels(rates=_overhead_rates(0.5, source="calibrated on 1 trials"),
                         memory_factors=(("z3-bf16-full-optcpu-pnone", 0.9),), time_samples=1,
                         measured_fits=frozenset())
    lines = calibration_table(spec=tiny, trials=study.trials, models=models).splitlines()
    # measured 2_200_000 - 200_000 (host share) = 2.000 MB; ledger 2.500 MB, err +25.0 %; this group has no
    # factor: calibrated = ledger (factor 1), err +25.0 %; no tokens_per_s attribute: measured shows 0 and
    # both speed errors "-"; mbs=4: M = 8/(4·2) = 1 micro-step, step 0.5 s -> 256 · 2 / 0.5 = 1,024 tokens/s
    assert lines[0].endswith("memory factors by group: z3-bf16-full-optcpu-pnone x0.900; MB = 10^6 bytes")
    assert lines[4] == ("| 0 | z0 fp32 ckpt=none mbs=4 | 2.000 | 2.500 | +25.0% | 2.500 | +25.0% | 0 | unknown | - "
                        "| 1,024 | - |")


def test_no_measured_trials_and_no_factors(tiny):
    models = StudyModels(rates=_overhead_rates(0.5, source="profile none"), memory_factors=(), time_samples=0,
                         measured_fits=frozenset())
    lines = calibration_table(spec=tiny, trials=[], models=models).splitlines()
    assert lines[0] == ("study cpu-tiny: 0 measured trial(s); time model profile none; memory factors by group: "
                        "none; MB = 10^6 bytes")
    assert lines[3:6] == ["|---|---|---|---|---|---|---|---|---|---|---|---|", "",
                          "fitted seconds per unit (profile → calibrated):"]
