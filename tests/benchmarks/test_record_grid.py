"""``benchmarks/record_grid.py --fidelity-again``: a recorded grid judged again from the losses its trial folders
kept, each candidate against the reference a study judges it by now (launchers/trial/reference_batches.py), with
nothing launched where the references are cached or are a recorded candidate's own run."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from launchers.trial.reference_batches import at_micro_batch
from launchers.trial.run import cached_reference_losses, keep_reference, reference_candidate, trial_dir_for
from optimizer.results.trial_result import loss_fidelity
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[2]


def _record_grid():
    spec = importlib.util.spec_from_file_location("record_grid", ROOT / "benchmarks" / "record_grid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recorded(study, candidate, losses, tokens_per_s):
    """A grid entry for ``candidate`` and the result.json its trial folder kept."""
    folder = trial_dir_for(study, candidate)
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps({"losses": losses, "tokens_per_s": tokens_per_s}))
    return {"label": candidate.label(), "knobs": candidate.knobs(), "outcome": "ok", "tokens_per_s": tokens_per_s,
            "loss_fidelity": 1.0}


def test_a_grid_is_judged_again_against_each_micro_batchs_reference(tmp_path):
    shutil.copy(ROOT / "studies" / "grid-lora-gpt2-cpu.yaml", tmp_path / "grid.yaml")
    study = load_study(tmp_path / "grid.yaml")  # GPT-2's dropouts draw masks per micro-batch; the reference's is 2
    base = baseline_candidate(study.training)
    reference = [5.0, 4.0]
    keep_reference(study, name="reference", candidate=reference_candidate(study), losses=reference)
    own = reference_candidate(at_micro_batch(study, 4))  # the micro-batch-4 reference's own candidate
    assert own.micro_batch_size == 4
    other = with_knobs(own, {"zero_stage": 2})
    at_two = with_knobs(base, {"zero_stage": 1, "micro_batch_size": 2})
    entries = [_recorded(study, own, [6.0, 5.0], 10.0), _recorded(study, other, [6.0, 5.5], 11.0),
               _recorded(study, at_two, [5.0, 4.5], 12.0)]
    out = tmp_path / "grid.json"
    data = {"candidates": entries}
    assert _record_grid().judge_again(study, data, out, reference) == 0
    fidelity = {e["label"]: e["loss_fidelity"] for e in json.loads(out.read_text())["candidates"]}
    assert fidelity[own.label()] == 0.0  # the reference itself, kept as it: nothing launched
    assert cached_reference_losses(at_micro_batch(study, 4), name="reference-mbs4") == [6.0, 5.0]
    assert fidelity[other.label()] == loss_fidelity([6.0, 5.5], [6.0, 5.0]) > 0
    assert fidelity[at_two.label()] == loss_fidelity([5.0, 4.5], reference) > 0


def test_a_trial_folder_of_another_run_is_refused_and_nothing_is_written(tmp_path, capsys):
    shutil.copy(ROOT / "studies" / "grid-lora-gpt2-cpu.yaml", tmp_path / "grid.yaml")
    study = load_study(tmp_path / "grid.yaml")
    candidate = with_knobs(baseline_candidate(study.training), {"zero_stage": 1})
    entry = _recorded(study, candidate, [5.0, 4.5], 12.0)
    entry["tokens_per_s"] = 13.0  # the folder holds another run than the one recorded
    out = tmp_path / "grid.json"
    assert _record_grid().judge_again(study, {"candidates": [entry]}, out, [5.0, 4.0]) == 2
    assert not out.exists() and "record the grid again" in capsys.readouterr().err


def test_a_grid_names_the_cpu_kernels_it_was_pinned_to(monkeypatch):
    # a recording with torch's and oneDNN's kernels pinned (an AMX machine made to run AVX2 kernels) says so; one
    # without a pin carries no such field
    record_grid = _record_grid()
    for name in record_grid.KERNEL_PINS:
        monkeypatch.delenv(name, raising=False)
    assert "kernels_pinned" not in record_grid.machine()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert record_grid.machine()["kernels_pinned"] == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
