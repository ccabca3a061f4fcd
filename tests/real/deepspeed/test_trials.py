"""Real short DeepSpeed trials on 2 CPU ranks: the four measurements, and every failure classified.

Each test runs ``launchers.trial.run.run_trial`` (``torch.distributed.run`` + ``DS_ACCELERATOR=cpu``) on a copy
of ``studies/cpu-tiny.yaml`` in a temporary folder, so outputs stay out of the repository.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from trial_processes import trial_processes

from launchers.models.builtin import build_model
from launchers.trial.local import LAUNCH_ID_VAR
from launchers.trial.reference_batches import judge_for, losses_for
from launchers.trial.reference_trial import reference_as_trial
from launchers.trial.run import reference_candidate, reference_losses, run_trial, trial_dir_for
from optimizer.results.trial_result import Outcome, loss_fidelity
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
ROOT = HERE.parents[2]


def _study_copy(folder: Path, **changes) -> Path:
    raw = yaml.safe_load((ROOT / "studies" / "cpu-tiny.yaml").read_text())
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        raw[section][key] = value
    path = folder / "cpu-tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    shutil.copy(HERE / "faulty_workloads.py", folder / "faulty_workloads.py")
    return path


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    return load_study(_study_copy(tmp_path_factory.mktemp("cpu_tiny")))


@pytest.fixture(scope="module")
def reference(study):
    return reference_losses(study)


@pytest.fixture(scope="module")
def baseline(study, reference):
    """The study's baseline candidate (stage 0, fp32, checkpointing none, micro-batch 2) for every test that asks
    for it. It is the FP32 reference's own candidate, so its trial is the reference run read back as a study records
    it (launchers/trial/reference_trial.py), files and all — not a second launch of the same run."""
    candidate = baseline_candidate(study.training)
    assert candidate == reference_candidate(study)
    result = reference_as_trial(study, candidate, trial_dir=trial_dir_for(study, candidate))
    assert result is not None
    return result


def _run(study, reference=None, **knobs):
    return run_trial(study=study, candidate=with_knobs(baseline_candidate(study.training), knobs),
                     reference_losses=reference)


def _no_rank_left(folder: Path) -> bool:
    """No rank of this test's own trials (under ``folder``) is alive; other dsopt runs on the machine are not ours."""
    return trial_processes(folder) == []


# The built-in GPT of cpu-tiny.yaml by hand (h = 64, 2 layers, ffn 4h = 256, vocab 256, learned positions for
# the 64-token sequence, tied head): per layer q, k, v, o 4·(64² + 64) = 16,640, two LayerNorms 256,
# MLP 64·256 + 256 + 256·64 + 64 = 33,088: 49,984 × 2 = 99,968; tokens 256·64 = 16,384; positions 64·64 = 4,096;
# final LayerNorm 128.
CPU_TINY_PARAMETERS = 120_576
# Bytes per parameter a rank holds at once, N = 2 ranks, fp32 with Adam: 4 (params) + 4 (grads) + 8 (exp_avg,
# exp_avg_sq), partitioned by stage as in the ZeRO paper (Rajbhandari et al. 2020, §5); at stages 1-3 DeepSpeed
# also keeps an fp32 master partition even in fp32 training (4/N; stage_1_and_2.py:560, measured in
# tests/real/deepspeed/test_model_states_real.py); at stage 0 it all-reduces a flattened copy of every gradient
# (+4; DeepSpeed 0.19.8 engine.py:3796 allreduce_bucket, one bucket of up to 5e8 elements).
LOWER_BOUND_BYTES_PER_PARAMETER = {0: 4 + 4 + 8 + 4, 1: 4 + 4 + (4 + 8) / 2, 2: 4 + (4 + 4 + 8) / 2,
                                   3: (4 + 4 + 4 + 8) / 2}
TOKENS_PER_STEP = 8 * 64  # cpu-tiny: global batch 8 x 64 tokens


def test_reference_is_cached_and_falls(study, reference):
    assert len(reference) == study.trial.warmup_steps + study.trial.measured_steps
    reports = [json.loads(path.read_text()) for path in sorted((study.output_dir / "reference").glob("rank*.json"))]
    assert [r["draws_random"] for r in reports] == [False, False]  # no dropout: nothing drawn while it trained
    assert reference[-1] < reference[0]  # the synthetic task is learnable
    cache = json.loads((study.output_dir / "reference.json").read_text())
    assert cache["losses"] == reference
    assert reference_losses(study) == reference  # served from the cache


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_measure_and_agree_with_fp32_reference(study, reference, stage, request):
    result = request.getfixturevalue("baseline") if stage == 0 else _run(study, reference, zero_stage=stage)
    assert result.outcome is Outcome.OK, result.message + result.log_tail
    assert result.loss_fidelity is not None and result.loss_fidelity <= 1e-4  # stage 0: the reference itself, 0
    trial_dir = study.output_dir / "trials" / f"z{stage}_fp32_ckpt=none_mbs=2"
    plan = json.loads((trial_dir / "plan.json").read_text())
    model = build_model(plan["model"], checkpointing=plan["checkpointing"])  # what the ranks built
    psi = sum(p.numel() for p in model.parameters())  # the tied head counted once
    assert psi == CPU_TINY_PARAMETERS
    # What every rank holds at once when it reduces and steps: a lower bound of the measured peak (1.2-2.4 MB
    # here). Activations, logits and DeepSpeed's buckets add 1.3-2.3 MB on this tiny model (peaks measured
    # 3.4-3.7 MB on 2026-12-01), too much to bound from above by hand.
    states = LOWER_BOUND_BYTES_PER_PARAMETER[stage] * psi
    assert all(r.peak_allocated_bytes >= states for r in result.ranks), (states, result.ranks)
    assert len(result.ranks) == 2 and all(r.peak_rss_bytes > result.peak_memory_bytes for r in result.ranks)
    assert result.peak_memory_bytes == max(r.peak_allocated_bytes for r in result.ranks)
    # Step time: per measured step the slowest rank, median over the steps; throughput from it.
    assert all(len(r.step_times_s) == study.trial.measured_steps for r in result.ranks)
    slowest = [max(times) for times in zip(*(r.step_times_s for r in result.ranks), strict=True)]
    assert result.step_time_s == statistics.median(slowest)
    assert result.tokens_per_s == pytest.approx(TOKENS_PER_STEP / result.step_time_s, rel=1e-12)
    assert study.trial.measured_steps * result.step_time_s < result.wall_s
    # The measured steps' cyclic collections, after the warm-up's heap was settled (launchers/measure/gc_pauses.py).
    assert all(r.gc_pause_s is not None and 0 <= r.gc_pause_s < result.wall_s for r in result.ranks)
    assert all(r.gc_full_collections is not None for r in result.ranks)
    assert all(g is not None and g > 0 for g in result.grad_norms)
    assert json.loads((trial_dir / "ds_config.json").read_text())["zero_optimization"]["stage"] == stage
    assert json.loads((trial_dir / "result.json").read_text())["outcome"] == "ok"


def test_cpu_optimizer_offload(study, reference):
    result = _run(study, reference, zero_stage=1, offload_optimizer="cpu")
    assert result.outcome is Outcome.OK, result.message + result.log_tail
    assert result.loss_fidelity <= 1e-4


def test_checkpointing_granularities_lower_the_peak_and_keep_the_losses(study, reference, baseline):
    peaks = {}
    for granularity in ("none", "full", "every_2", "selective"):
        result = baseline if granularity == "none" else _run(study, reference, checkpointing=granularity)
        assert result.outcome is Outcome.OK, result.message + result.log_tail
        assert result.loss_fidelity <= 1e-6  # recomputation repeats the same fp32 math
        peaks[granularity] = result.peak_memory_bytes
    assert peaks["full"] < peaks["every_2"] < peaks["none"]
    assert peaks["selective"] < peaks["none"]


def test_micro_batch_1_and_2_give_the_same_losses(study, reference, baseline):
    assert study.training.micro_batch_size == 2  # the baseline's
    one, two = _run(study, reference, micro_batch_size=1), baseline
    assert one.outcome is two.outcome is Outcome.OK
    assert max(abs(a - b) / b for a, b in zip(one.losses, two.losses, strict=True)) <= 1e-5


def test_fp16_on_cpu_ranks_is_unsupported_where_deepspeed_refuses_it(tmp_path):
    # A study that claims fp16 support for CPU ranks: the ledger lets it through and DeepSpeed decides.
    # DeepSpeed's CPU accelerator accepts fp16 only where oneDNN supports it (accelerator/cpu_accelerator.py:
    # is_fp16_supported -> torch.ops.mkldnn._is_mkldnn_fp16_supported(), e.g. AVX512-FP16/AMX CPUs); elsewhere
    # it raises ValueError("Type fp16 is not supported on your device.").
    import torch

    study = load_study(_study_copy(tmp_path, hardware__supported_precisions=["fp32", "bf16", "fp16"]))
    result = _run(study, precision="fp16")
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        assert result.outcome is Outcome.OK, result.message + result.log_tail
    else:
        assert result.outcome is Outcome.UNSUPPORTED, result.message + result.log_tail
        assert "fp16 is not supported" in result.message
    assert _no_rank_left(tmp_path)


@pytest.mark.parametrize(("workload", "outcome"), [("nan_workload", Outcome.NAN), ("crash_workload", Outcome.CRASH),
                                                   ("oom_workload", Outcome.OOM)])
def test_failures_are_classified(tmp_path, workload, outcome):
    study = load_study(_study_copy(tmp_path, model__entry_point=f"faulty_workloads:{workload}"))
    result = _run(study)
    assert result.outcome is outcome, result.message + result.log_tail
    assert result.log_tail
    assert _no_rank_left(tmp_path)


def test_a_hang_times_out_and_leaves_no_process(tmp_path):
    study = load_study(_study_copy(tmp_path, model__entry_point="faulty_workloads:hang_workload",
                                   trial__timeout_s=20))  # the hang is reached ~6 s in on 2 CPU cores
    result = _run(study)
    assert result.outcome is Outcome.TIMEOUT
    assert (study.path.parent / "hang_reached.marker").exists()  # the ranks were stuck mid-run, not importing
    assert result.wall_s < 20 + 15
    assert _no_rank_left(tmp_path)


def test_cli_trial_json_of_bf16_within_its_tolerance(study, reference):
    """``dsopt trial --json`` in its own process (the reference from the cache), on a candidate no other test here
    launches: ZeRO-2 bf16, whose losses differ from the fp32 reference by more than 0 and at most bf16's tolerance."""
    proc = subprocess.run([sys.executable, "-m", "optimizer.cli", "trial", str(study.path), "--set", "zero_stage=2",
                           "--set", "precision=bf16", "--json"], capture_output=True, text=True, check=False,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    for key in ("outcome", "peak_memory_bytes", "tokens_per_s", "step_time_s", "losses", "loss_fidelity",
                "predicted"):
        assert key in data
    assert data["outcome"] == "ok" and isinstance(data["peak_memory_bytes"], int)
    assert 0 < data["loss_fidelity"] <= study.trial.tolerance(with_knobs(
        baseline_candidate(study.training), {"precision": "bf16"}).precision)
    assert LAUNCH_ID_VAR not in proc.stdout


def test_with_dropout_a_candidate_is_judged_against_the_reference_of_its_micro_batch(tmp_path):
    # Dropout draws a micro-batch's masks at once, layer after layer: at micro-batch 1 the samples get other masks
    # than at the reference's 2, and the losses part by the masks' noise (launchers/trial/reference_batches.py).
    study = load_study(_study_copy(tmp_path, model__dropout=True))
    assert study.training.micro_batch_size == 2
    base = reference_losses(study)
    reports = [json.loads(path.read_text()) for path in sorted((study.output_dir / "reference").glob("rank*.json"))]
    assert len(reports) == 2 and all(r["draws_random"] for r in reports)  # the ranks saw the masks drawn
    candidate = with_knobs(baseline_candidate(study.training), {"zero_stage": 1, "micro_batch_size": 1})
    judged = losses_for(judge_for(study, candidate), base)
    assert (study.output_dir / "reference-mbs1.json").is_file() and judged != base
    result = run_trial(study=study, candidate=candidate, reference_losses=judged)
    assert result.outcome is Outcome.OK
    assert result.loss_fidelity <= 1e-6, result.loss_fidelity  # ZeRO-1 at the same masks: reductions reordered only
    assert loss_fidelity(result.losses, base) > study.trial.tolerance(candidate.precision)  # the masks' noise
