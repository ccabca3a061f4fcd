"""The probe's ranks merged into one figure per operation, its cache key, and `dsopt probe`'s refusals (no launch)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from launchers.probe.machine import (
    cache_key,
    cached_probe,
    collect_riding,
    merge,
    rank_input,
    riding_input,
    with_probe,
)
from launchers.trial.run import probe_seconds
from optimizer.cli import main
from optimizer.perf.probe_plan import probe_plan
from optimizer.study.knobs import ZeroStage
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]


def test_merge_takes_the_slowest_ranks_median_and_every_rounds_spread():
    plan = probe_plan(load_study(ROOT / "studies" / "grid-cpu.yaml"))
    reports = [{"rank": 0, "seconds": 2.0, "skipped": [{"what": "host_adam", "why": "not built"}],
                "figures": [{"kind": "all_reduce", "work": 8192, "rounds_s": [1.0, 2.0, 3.0, 4.0, 5.0]}]},
               {"rank": 1, "seconds": 3.0, "skipped": [{"what": "host_adam", "why": "not built"}],
                "figures": [{"kind": "all_reduce", "work": 8192, "rounds_s": [0.5, 6.0, 7.0, 8.0, 9.0]}]}]
    probe = merge(reports, plan=plan, machine="here")
    (figure,) = probe.figures
    assert (figure.median_s, figure.low_s, figure.high_s, figure.repeats) == (7.0, 0.5, 9.0, 5)
    assert probe.seconds == 3.0 and probe.ranks == 2 and probe.skipped == (("host_adam", "not built"),)


def test_cache_key_is_the_plan_and_the_machine(monkeypatch):
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    demo = load_study(ROOT / "studies" / "demo-cpu.yaml")
    plan = probe_plan(study)
    assert cache_key(study, plan) == cache_key(demo, probe_plan(demo))  # the same shapes and space: one probe
    longer = replace(demo, trial=replace(demo.trial, warmup_steps=4, measured_steps=15))  # the engine rounds are
    assert cache_key(longer, probe_plan(longer)) == cache_key(demo, probe_plan(demo))     # the probe's, not these
    reseeded = replace(demo, trial=replace(demo.trial, seed=1))  # the skeleton's weights and batch: its own probe
    assert cache_key(reseeded, probe_plan(reseeded)) != cache_key(demo, probe_plan(demo))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    big = load_study(ROOT / "studies" / "llama-7b-8xh100.yaml")
    assert cache_key(big, probe_plan(big)) != cache_key(study, plan)
    # what trains changes DeepSpeed's cost, not the plan's shapes: the engines' plans are in the key
    lora = replace(study, model=replace(study.model, peft='{"peft_type":"LORA","r":2,"target_modules":["q"]}'))
    assert probe_plan(lora).gemm_shapes == plan.gemm_shapes and cache_key(lora, probe_plan(lora)) != cache_key(
        study, plan)
    engines = rank_input(lora, probe_plan(lora))["engines"]
    assert engines[0]["model"]["peft"]["r"] == 2 and engines[0]["model"]["hidden_size"] < study.model.hidden_size
    # each stage of the space in its 16-bit precision, then the lowest again with every block checkpointed (the
    # space recomputes blocks), then the stages below ZeRO-2 in fp32: DeepSpeed wraps the optimizer by precision
    # (ZeRO-2 is ZeRO-1's class, ZeRO-3 keeps fp32 master weights as they do: they take ZeRO-1's factor)
    assert [(e["stage"], e["checkpointing"], e["precision"]) for e in engines] == [
        (0, "none", "bf16"), (1, "none", "bf16"), (2, "none", "bf16"), (3, "none", "bf16"), (0, "full", "bf16"),
        (0, "none", "fp32"), (1, "none", "fp32")]
    high = replace(lora, search_space=replace(lora.search_space, values=(("zero_stage", (ZeroStage.GRADIENTS,
                                                                                          ZeroStage.PARAMETERS)),)))
    assert probe_plan(high).engine_other_stages == (2,)  # no stage below ZeRO-2 in the space: its lowest sharded
    gap = replace(lora, search_space=replace(lora.search_space, values=(("zero_stage", (
        ZeroStage.DISABLED, ZeroStage.PARAMETERS)),)))
    assert probe_plan(gap).engine_other_stages == (0, 3)  # ZeRO-0's bare optimizer lends to no sharded stage
    assert all(("bf16" in e["config"]) is (e["precision"] == "bf16") for e in engines)
    passes = rank_input(lora, probe_plan(lora))["passes"]  # the model's pass: its width, what trains, two blocks
    assert passes[0]["model"]["peft"]["r"] == 2 and passes[0]["model"]["hidden_size"] == study.model.hidden_size
    assert [p["precision"] for p in passes] == ["fp32", "bf16"] and passes[0]["model"]["layers"] == 2
    assert all(e["config"]["gradient_accumulation_steps"] == 2 and e["sequence_length"] == 16 for e in engines)


def test_a_cuda_study_on_a_machine_without_cuda_keeps_its_profile(monkeypatch):
    monkeypatch.delenv("DSOPT_PROBE", raising=False)  # the suite's default (tests/conftest.py): this test probes
    study = load_study(ROOT / "studies" / "llama-7b-8xh100.yaml")
    said: list[str] = []
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert with_probe(study, say=said.append) is study
    assert "no probe of this machine (the study trains on CUDA GPUs and this machine has none)" in said[0]


@pytest.mark.parametrize(("study", "says"), [
    ("seed-1b-2x24gb.yaml", "model.kind: a seed-mode model has no shape to probe"),
    ("llama-7b-8xh100.yaml", "hardware"),
])
def test_dsopt_probe_refuses_what_it_cannot_probe(study, says, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path))
    assert main(["probe", str(ROOT / "studies" / study)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and study in err
    assert not any(tmp_path.iterdir())  # nothing written


def test_nvme_rounds_write_and_read_a_file_and_leave_nothing(tmp_path):
    from launchers.rank.probe_rank import ROUNDS, nvme_rounds

    for write in (True, False):
        seconds = nvme_rounds(tmp_path, size=2 << 20, write=write)
        assert len(seconds) == ROUNDS and all(s > 0 for s in seconds)
    assert not any(tmp_path.iterdir())


def test_probe_off_takes_only_a_cached_probe(monkeypatch, tmp_path):
    monkeypatch.setenv("DSOPT_PROBE", "off")
    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path))
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    said: list[str] = []
    assert with_probe(study, say=said.append) is study and "DSOPT_PROBE=off" in said[0]
    assert not any(tmp_path.iterdir())  # nothing launched, nothing written


def test_the_reference_launch_carries_the_probe_only_where_the_study_would_probe_and_it_can(monkeypatch, tmp_path):
    monkeypatch.delenv("DSOPT_PROBE", raising=False)
    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path))
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    riding = riding_input(study)
    assert riding == rank_input(study, probe_plan(study)) and riding["engines"]
    script = replace(study, trial=replace(study.trial, command=("python", "train.py")))
    two_nodes = replace(study, hardware=replace(study.hardware, nodes=2))
    assert riding_input(script) is None and riding_input(two_nodes) is None  # not dsopt's rank program; two nodes
    monkeypatch.setenv("DSOPT_PROBE", "off")
    assert riding_input(study) is None
    assert not any(tmp_path.iterdir())  # asking launches and writes nothing


def test_the_riding_probe_is_merged_cached_and_its_seconds_are_not_the_trials(monkeypatch, tmp_path):
    monkeypatch.delenv("DSOPT_PROBE", raising=False)
    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path / "cache"))
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    folder = tmp_path / "reference"
    folder.mkdir()
    said: list[str] = []
    assert collect_riding(study, folder, say=said.append) is None and probe_seconds(folder) == 0.0  # no report
    assert said == ["the probe within the FP32 reference's launch left no report on rank(s) 0, 1 (it did not finish "
                    "there)"]
    figure = {"kind": "gemm", "precision": "fp32", "micro_batch": 1, "work": 1e9, "rounds_s": [0.1, 0.2, 0.3]}
    (folder / "probe_rank0.json").write_text(json.dumps({"rank": 0, "seconds": 7.5, "figures": [figure],
                                                         "skipped": []}))
    said.clear()
    assert collect_riding(study, folder, say=said.append) is None and cached_probe(study) is None  # rank 1 missing
    assert said == ["the probe within the FP32 reference's launch left no report on rank(s) 1 (it did not finish "
                    "there)"]
    (folder / "probe_rank0.json").unlink()  # rank 0 ended by torchrun, rank 1 failed first: its reason is said
    (folder / "probe_rank1.json").write_text(json.dumps({"rank": 1, "error": "RuntimeError: gloo"}))
    said.clear()
    assert collect_riding(study, folder, say=said.append) is None and cached_probe(study) is None
    assert said == ["the probe within the FP32 reference's launch failed on rank 1: RuntimeError: gloo"]
    (folder / "probe_rank0.json").write_text(json.dumps({"rank": 0, "seconds": 7.5, "figures": [figure],
                                                         "skipped": []}))
    (folder / "probe_rank1.json").write_text(json.dumps({"rank": 1, "seconds": 8.0, "figures": [figure],
                                                         "skipped": []}))
    probe = collect_riding(study, folder, say=said.append)
    assert probe is not None and probe.find("gemm", precision="fp32", micro_batch=1).median_s == 0.2
    assert cached_probe(study) == probe and riding_input(study) is None  # cached: the next study probes nothing
    assert "8.0 s of timing, 1 figures" in said[-1] and probe_seconds(folder) == 8.0
