"""The device as a trial measured it, turned into what a study plans with (optimizer/results/device_budget.py), kept on
the Optuna study (optimizer/search/device_attrs.py), and carried by the trial result and its report. Pure; figures
worked by hand."""

from __future__ import annotations

import json
import textwrap

import optuna
import pytest
from trial_fixtures import rank_report

from launchers.trial.run import result_json
from optimizer.ledger.core import evaluate
from optimizer.results.device_budget import (
    capacity_budget,
    capacity_note,
    measured_device_reserve,
    planning_spec,
    with_measured_reserve,
)
from optimizer.results.trial_report import trial_json, trial_table
from optimizer.results.trial_result import RankMeasurement, TrialResult, summarize
from optimizer.search.device_attrs import (
    CAPACITY_ATTR,
    RESERVE_ATTR,
    measured_capacity,
    measured_reserve,
    record_device,
    record_result_json,
    study_planning_spec,
)
from optimizer.study.errors import UserError
from optimizer.study.hardware_section import CUDA_DEVICE_RESERVE_BYTES
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

MiB = 2**20
GiB = 2**30
H100_TOTAL = 85_029_158_912
"""``torch.cuda.get_device_properties(0).total_memory`` of an H100 SXM "80 GB": 79.19 GiB (docs/sources.md)."""

STUDY = """
name: gpus
model: {{kind: transformer, layers: 4, hidden_size: 512, heads: 8, vocab_size: 32000}}
hardware:
  accelerator: {accelerator}
  gpus_per_node: 2
  gpu_memory: {memory}
{extra}training: {{global_batch_size: 16, micro_batch_size: 8, sequence_length: 512}}
search_space: {{knobs: {{zero_stage: [0, 1], precision: [fp32, bf16]}}}}
"""


def _study(tmp_path, *, memory="80 GiB", accelerator="cuda", **hardware):
    extra = "".join(f"  {key}: {value}\n" for key, value in hardware.items())
    path = tmp_path / "gpus.yaml"
    path.write_text(textwrap.dedent(STUDY.format(memory=memory, accelerator=accelerator, extra=extra)))
    return load_study(path)


def _cuda_rank(rank, *, non_torch_init, non_torch_peak, used_init=3 * GiB, used_peak=9 * GiB, total=H100_TOTAL):
    return rank_report(rank, peak_reserved_bytes=8 * GiB, init_peak_reserved_bytes=2 * GiB,
                       training_peak_reserved_bytes=8 * GiB, device_name="NVIDIA H100 80GB HBM3",
                       device_total_bytes=total, device_memory_source="nvml_process",
                       device_used_init_bytes=used_init, device_non_torch_init_bytes=non_torch_init,
                       device_used_peak_bytes=used_peak, device_non_torch_peak_bytes=non_torch_peak)


def _summarize(reports):
    return summarize(rank_reports=reports, world_size=len(reports), returncode=0, timed_out=False,
                     tokens_per_step=8192, reference_losses=None, log_tail="", wall_s=1.0)


def _cuda_result():
    # rank 0: 600 MiB outside PyTorch's pool after init, 700 MiB at its largest step reading;
    # rank 1: 650 MiB, 690 MiB. The reserve: the most of any rank at either moment, 700 MiB.
    return _summarize({0: _cuda_rank(0, non_torch_init=600 * MiB, non_torch_peak=700 * MiB),
                       1: _cuda_rank(1, non_torch_init=650 * MiB, non_torch_peak=690 * MiB, used_peak=9 * GiB + 1)})


# --- the trial result carries the readings ---

def test_the_readings_reach_the_result_and_its_json_and_back():
    result = _cuda_result()
    assert result.device_memory_source == "nvml_process"
    assert (result.device_used_init_bytes, result.device_used_peak_bytes) == (3 * GiB, 9 * GiB + 1)
    assert (result.device_non_torch_init_bytes, result.device_non_torch_peak_bytes) == (650 * MiB, 700 * MiB)
    assert result.device_total_bytes == H100_TOTAL
    data = json.loads(json.dumps(result_json(result)))  # as result.json holds it
    back = tuple(RankMeasurement(**{**rank, "step_times_s": tuple(rank["step_times_s"])}) for rank in data["ranks"])
    assert back == result.ranks


def test_cpu_ranks_have_no_device_readings():
    cpu = _summarize({0: rank_report(0), 1: rank_report(1)})  # as CPU ranks write them: no device_* keys
    empty = {"device_memory_source": None, "device_used_init_bytes": None, "device_non_torch_init_bytes": None,
             "device_used_peak_bytes": None, "device_non_torch_peak_bytes": None}
    also_cpu = _summarize({0: rank_report(0, **empty), 1: rank_report(1, **empty)})  # written with the keys
    for result in (cpu, also_cpu):
        assert result.device_memory_source is None and result.device_used_init_bytes is None
        assert result.device_used_peak_bytes is None and result.device_non_torch_init_bytes is None
        assert measured_device_reserve(result) is None
        data = trial_json(result=result, ledger=None, tolerance=1e-4, trial_dir="t", study="cpu-tiny")
        assert "device used" not in trial_table(data) and "device total memory" not in trial_table(data)


def test_the_report_shows_the_device_beside_the_study(tmp_path):
    study = _study(tmp_path)
    ledger = evaluate(candidate=baseline_candidate(study.training), model=study.model, hardware=study.hardware,
                      training=study.training).ledger
    data = trial_json(result=_cuda_result(), ledger=ledger, tolerance=1e-4, trial_dir="t", study="gpus")
    assert data["device_used_peak_bytes"] == 9 * GiB + 1 and data["device_non_torch_init_bytes"] == 650 * MiB
    assert data["gpu_capacity_bytes"] == 80 * GiB and data["device_total_bytes"] == H100_TOTAL
    assert data["predicted_device_reserve_bytes"] == CUDA_DEVICE_RESERVE_BYTES
    table = trial_table(data)
    # 3 GiB = 3,221.225 MB; 700 MiB = 734.003 MB; 1 GiB = 1,073.742 MB; 80 GiB = 85,899.346 MB
    assert ("device used as the driver sees it (nvml_process; read at moments, not a peak): after init "
            "3221.225 MB") in table
    assert "at the largest reading 734.003 MB; the ledger's device reserve 1073.742 MB" in table
    assert "device total memory 85029.159 MB (NVIDIA H100 80GB HBM3); the study's gpu_memory 85899.346 MB: more " \
           "than the device has" in table


# --- the measured reserve ---

def test_the_measured_reserve_is_the_most_outside_pytorchs_pool():
    assert measured_device_reserve(_cuda_result()) == 700 * MiB
    stopped_at_init = _summarize({0: _cuda_rank(0, non_torch_init=600 * MiB, non_torch_peak=None, used_peak=None)})
    assert measured_device_reserve(stopped_at_init) == 600 * MiB  # no step: the init reading alone
    negative = _summarize({0: _cuda_rank(0, non_torch_init=-5, non_torch_peak=-1)})
    assert measured_device_reserve(negative) is None  # a reader that did not see this process's own use
    assert measured_device_reserve(TrialResult(outcome="crash")) is None  # failed before it measured


def test_a_stated_reserve_always_wins_and_a_measured_one_replaces_the_default(tmp_path):
    default = _study(tmp_path)
    assert not default.hardware.device_reserve_stated and default.hardware.device_reserve_bytes == 1 * GiB
    planned = with_measured_reserve(default, measured_reserve_bytes=700 * MiB)
    assert planned.hardware.device_reserve_bytes == 700 * MiB and not planned.hardware.device_reserve_stated
    assert planned.hardware.gpu_memory_bytes == 80 * GiB and planned.model == default.model
    assert with_measured_reserve(default, measured_reserve_bytes=None) is default  # nothing measured: 1 GiB
    stated = _study(tmp_path, device_reserve="2 GiB")
    assert with_measured_reserve(stated, measured_reserve_bytes=700 * MiB) is stated
    with pytest.raises(UserError, match=r"hardware\.gpu_memory: a trial measured 80\.00 GiB"):
        with_measured_reserve(default, measured_reserve_bytes=80 * GiB)


def test_the_ledger_plans_with_what_was_measured(tmp_path):
    study = _study(tmp_path)
    planned = planning_spec(study, measured_reserve_bytes=700 * MiB, measured_total_bytes=H100_TOTAL)
    ledger = evaluate(candidate=baseline_candidate(planned.training), model=planned.model,
                      hardware=planned.hardware, training=planned.training).ledger
    assert ledger.gpu_capacity_bytes == H100_TOTAL and ledger.device_reserve_bytes == 700 * MiB
    assert planning_spec(study, measured_reserve_bytes=None, measured_total_bytes=None) is study


# --- the capacity ---

def test_the_budget_is_the_smaller_of_the_study_and_the_device(tmp_path):
    assert capacity_budget(_study(tmp_path).hardware, measured_total_bytes=H100_TOTAL) == H100_TOTAL
    assert capacity_budget(_study(tmp_path, memory="40 GiB").hardware, measured_total_bytes=H100_TOTAL) == 40 * GiB
    assert capacity_budget(_study(tmp_path).hardware, measured_total_bytes=None) == 80 * GiB


def test_the_note_says_the_study_asks_more_than_the_device_has(tmp_path):
    note = capacity_note(_study(tmp_path).hardware, measured_total_bytes=H100_TOTAL)
    assert note == ("hardware.gpu_memory says 80.00 GiB (85.90 GB); the device has 79.19 GiB (85.03 GB) "
                    "(torch.cuda.get_device_properties().total_memory): planning with the device's")
    decimal = capacity_note(_study(tmp_path, memory="80 GB").hardware, measured_total_bytes=79 * 10**9)
    assert decimal.startswith("hardware.gpu_memory says 80.00 GB (74.51 GiB); the device has 79.00 GB (73.57 GiB)")
    assert capacity_note(_study(tmp_path, memory="40 GiB").hardware, measured_total_bytes=H100_TOTAL) is None
    assert capacity_note(_study(tmp_path).hardware, measured_total_bytes=None) is None


def test_a_budget_cut_below_the_stated_reserve_is_refused(tmp_path):
    study = _study(tmp_path, memory="4 GiB", device_reserve="3 GiB")
    with pytest.raises(UserError, match=r"hardware\.device_reserve: 3\.00 GiB"):
        planning_spec(study, measured_reserve_bytes=None, measured_total_bytes=2 * GiB)


# --- kept on the Optuna study ---

def test_the_study_keeps_the_first_reserve_and_the_smallest_capacity(tmp_path):
    study = optuna.create_study(directions=["minimize", "maximize"])
    spec = _study(tmp_path)
    assert measured_reserve(study) is None and measured_capacity(study) is None
    cpu = _summarize({0: rank_report(0)})
    assert record_device(study, cpu) == (None, None)
    assert RESERVE_ATTR not in study.user_attrs and CAPACITY_ATTR not in study.user_attrs
    assert study_planning_spec(spec, study) is spec  # nothing measured: the published default, the study's memory
    assert record_device(study, _cuda_result()) == (700 * MiB, H100_TOTAL)
    later = _summarize({0: _cuda_rank(0, non_torch_init=900 * MiB, non_torch_peak=950 * MiB,
                                      total=H100_TOTAL - 1)})
    assert record_device(study, later) == (700 * MiB, H100_TOTAL - 1)  # the first reserve stays; the smallest
    assert record_device(study, _cuda_result()) == (700 * MiB, H100_TOTAL - 1)
    assert study.user_attrs == {RESERVE_ATTR: 700 * MiB, CAPACITY_ATTR: H100_TOTAL - 1}
    planned = study_planning_spec(spec, study)
    assert planned.hardware.device_reserve_bytes == 700 * MiB
    assert planned.hardware.gpu_memory_bytes == H100_TOTAL - 1


def test_the_references_result_file_sets_both_before_any_search_trial():
    study = optuna.create_study(directions=["minimize", "maximize"])
    record_result_json(study, json.loads(json.dumps(result_json(_cuda_result()))))  # as result.json holds it
    assert study.user_attrs == {RESERVE_ATTR: 700 * MiB, CAPACITY_ATTR: H100_TOTAL}
    cpu = optuna.create_study(directions=["minimize", "maximize"])
    record_result_json(cpu, json.loads(json.dumps(result_json(_summarize({0: rank_report(0)})))))
    assert cpu.user_attrs == {}


def test_a_launch_reads_the_study_attributes_once(monkeypatch):
    study = optuna.create_study(directions=["minimize", "maximize"])
    reads = []
    original = optuna.Study.user_attrs
    monkeypatch.setattr(optuna.Study, "user_attrs", property(lambda self: reads.append(1) or original.fget(self)))
    record_device(study, _summarize({0: rank_report(0)}))  # CPU ranks: nothing to keep
    assert len(reads) == 1
    assert record_device(study, _cuda_result()) == (700 * MiB, H100_TOTAL)  # both kept, one read
    assert len(reads) == 2
