"""The recorded grid and the replayed strategies of benchmarks/search_efficiency.py (fast parts only)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import optuna
import pytest

ROOT = Path(__file__).resolve().parents[2]
GRID = ROOT / "benchmarks" / "data" / "grid-cpu.json"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("search_efficiency", ROOT / "benchmarks" / "search_efficiency.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["grid-cpu", "grid-llama-cpu", "grid-qwen2-cpu"])
def test_the_grid_is_complete_and_describes_its_machine(name):
    data = json.loads((ROOT / "benchmarks" / "data" / f"{name}.json").read_text())
    assert len(data["candidates"]) == 84 and {"cpu", "cores", "versions"} <= set(data["machine"])
    assert data["command"].startswith("python benchmarks/record_grid.py")
    assert data["study_file"] == f"studies/{name}.yaml"
    assert len({e["label"] for e in data["candidates"]}) == 84  # every valid candidate once
    assert all(e["outcome"] in ("ok", "oom", "crash", "nan", "timeout", "unsupported") for e in data["candidates"])


def test_autotuner_walk_tunes_only_stage_and_micro_batch(bench):
    grid = bench.load_grid(GRID)
    run = bench.run_autotuner(grid)
    knobs = [grid.entries[label]["knobs"] for label in run.launched]
    assert {k["precision"] for k in knobs} == {"fp32"} and {k["checkpointing"] for k in knobs} == {"none"}
    assert {k["offload_optimizer"] for k in knobs} == {"none"}
    stages = [k["zero_stage"] for k in knobs]
    assert stages == sorted(stages)  # stages walked in order 0 -> 3


# A grid small enough to judge by hand (per-rank budget of studies/grid-cpu.yaml: 3 MB = 3,000,000 bytes;
# fidelity tolerances: fp32 1e-4, bf16 2e-2, optimizer.study.specs.TrialSettings). Device share = measured peak −
# the ledger's host items (CPU ranks keep offloaded states in the same memory).
HAND_GRID = [
    # label, outcome, measured peak, host items, loss fidelity, tokens/s
    ("z0 fp32 ckpt=none mbs=1", "ok", 2_900_000, 0, 1e-7, 1000.0),  # fits, fidelity ok: feasible, slow
    ("z1 fp32 ckpt=none mbs=1 opt->cpu", "ok", 3_500_000, 600_000, 1e-6, 1990.0),  # device 2.9 MB: feasible
    ("z0 fp32 ckpt=none mbs=2", "ok", 3_000_001, 0, 1e-7, 5000.0),  # 1 byte over the budget: OOM launch
    ("z0 fp32 ckpt=none mbs=4", "oom", None, 0, None, None),  # ran out of memory: OOM launch
    ("z0 bf16 ckpt=none mbs=1", "ok", 2_000_000, 0, 3e-2, 4000.0),  # fidelity 3e-2 > 2e-2: infeasible
    ("z0 bf16 ckpt=none mbs=2", "ok", 2_500_000, 0, 1e-2, 2000.0),  # feasible, the fastest feasible
    ("z2 fp32 ckpt=none mbs=1", "ok", 3_000_000, 0, None, 900.0),  # exactly the budget: no OOM; no fidelity
    ("z3 fp32 ckpt=none mbs=1", "crash", None, 0, None, None),  # neither OOM nor feasible
]
# By hand: OOM launches {mbs=2, mbs=4 fp32 z0}; feasible {z0 fp32 mbs=1, z1 opt->cpu, z0 bf16 mbs=2};
# best feasible 2000 tokens/s, target 0.98 x 2000 = 1960: hits {z1 opt->cpu (1990), z0 bf16 mbs=2 (2000)}.
HAND_OOM = {"z0 fp32 ckpt=none mbs=2", "z0 fp32 ckpt=none mbs=4"}
HAND_FEASIBLE = {"z0 fp32 ckpt=none mbs=1", "z1 fp32 ckpt=none mbs=1 opt->cpu", "z0 bf16 ckpt=none mbs=2"}
HAND_HITS = {"z1 fp32 ckpt=none mbs=1 opt->cpu", "z0 bf16 ckpt=none mbs=2"}


@pytest.fixture
def hand_grid(bench, tmp_path):
    entries = []
    for label, outcome, peak, host, fidelity, speed in HAND_GRID:
        stage, precision = label.split()[:2]
        entries.append({"label": label, "knobs": {"zero_stage": int(stage[1]), "precision": precision},
                        "outcome": outcome, "measured_peak_bytes": peak, "predicted_host_bytes": host,
                        "loss_fidelity": fidelity, "tokens_per_s": speed})
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"study_file": "studies/grid-cpu.yaml", "candidates": entries}))
    return bench.load_grid(path)


def test_the_ground_truth_of_a_hand_counted_grid(hand_grid):
    entries = hand_grid.entries
    assert hand_grid.best_tokens_per_s == 2000.0
    assert {label for label, e in entries.items() if hand_grid.oom(e)} == HAND_OOM
    assert {label for label, e in entries.items() if hand_grid.feasible(e)} == HAND_FEASIBLE
    assert {label for label, e in entries.items() if hand_grid.hit(e)} == HAND_HITS


RANDOM_SEEDS = 200


def test_random_launches_distinct_candidates_until_its_first_hit_in_a_seeded_random_order(bench, hand_grid):
    # Laws of "the valid candidates in a random order" stopped at the first hit (module doc), for HAND_GRID's
    # 8 labels of which 2 are hits. Worked by hand for a uniformly random order: each label is launched first
    # with probability 1/8 (25 of 200 runs expected, binomial sd √(200·1/8·7/8) = 4.7); the first hit lands at
    # launch i with probability (8 − i)/C(8, 2) = (8 − i)/28 for i = 1..7, so at most 6 misses precede it, its
    # mean is Σ i·(8 − i)/28 = 84/28 = 3 and its variance Σ i²·(8 − i)/28 − 3² = 336/28 − 9 = 3 (sd of a mean of
    # 200 runs √(3/200) = 0.12). The bounds below sit ≥ 4.9 sd from those expectations.
    firsts: Counter[str] = Counter()
    lengths = []
    for seed in range(RANDOM_SEEDS):
        run = bench.run_random(hand_grid, seed=seed)
        launched = run.launched
        assert len(set(launched)) == len(launched) and set(launched) <= set(hand_grid.entries)  # no relaunch
        assert launched[-1] in HAND_HITS and not set(launched[:-1]) & HAND_HITS  # stops at its first hit
        assert run.reached_at == len(launched)
        assert run.ooms(hand_grid) == len(set(launched) & HAND_OOM)
        assert bench.run_random(hand_grid, seed=seed).launched == launched  # the seed fixes the run
        firsts[launched[0]] += 1
        lengths.append(len(launched))
    assert set(firsts) == set(hand_grid.entries)  # every label is launched first in some run: not a fixed order
    assert max(firsts.values()) <= 50  # 25 expected: no label dominates the first launch
    assert max(lengths) <= len(HAND_GRID) - len(HAND_HITS) + 1  # 6 misses at most, then a hit
    assert 2.4 <= sum(lengths) / RANDOM_SEEDS <= 3.6  # 3 expected (above)


def test_a_grid_replays_with_the_probe_recorded_beside_it_unless_told_not_to(bench, tmp_path):
    from optimizer.perf.throughput import profile_rates
    from optimizer.study.machine_probe import MachineProbe, ProbeFigure

    probe = MachineProbe(machine="the recording machine", measured_at="2026-12-06T00:00:00+00:00", ranks=2,
                         seconds=1.0, figures=(ProbeFigure(kind="host_adam", work=1e6, median_s=1e-3, low_s=1e-3,
                                                           high_s=1e-3, repeats=5),))
    entries = [{"label": "z0 fp32 ckpt=none mbs=1", "knobs": {"zero_stage": 0, "precision": "fp32"}, "outcome": "ok",
                "measured_peak_bytes": 1, "predicted_host_bytes": 0, "loss_fidelity": 0.0, "tokens_per_s": 1.0}]
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"study_file": "studies/grid-cpu.yaml", "candidates": entries,
                                "probe": probe.to_json()}))
    assert bench.load_grid(path).spec.hardware.probe == probe
    assert "probe 2026-12-06" in profile_rates(hardware=bench.load_grid(path).spec.hardware).source
    assert bench.load_grid(path, probe=False).spec.hardware.probe is None


def test_a_budget_no_candidate_fits_is_one_clear_error(bench, capsys, monkeypatch):
    # the wide QLoRA grid's runs all peak at dsopt's own init (6.9-9.1 MB): nothing fits its 4 MB
    with pytest.raises(bench.NothingFeasible, match="no candidate fits 4 MB per rank"):
        bench.load_grid(ROOT / "benchmarks" / "data" / "grid-qlora-wide-cpu.json")
    monkeypatch.setattr(sys, "argv", ["search_efficiency.py", "--grid", str(GRID), "--budget", "1 kB", "--seeds", "1"])
    assert bench.main() == 2
    assert "nothing to search for" in capsys.readouterr().err


def test_the_replayed_study_records_the_reference_run_before_its_first_launch(bench, tmp_path):
    # a real study's FP32 reference run is a whole trial of its candidate, recorded with no launch before the first
    # one (launchers/trial/reference_trial.py): the replay records the grid's measurement of it the same way
    from dataclasses import replace

    from launchers.trial.run import reference_candidate
    grid = bench.load_grid(GRID, budget_bytes=3_500_000)
    reference = reference_candidate(grid.spec).label()
    run = bench.run_dsopt(grid, 0, tmp_path)
    study = optuna.load_study(study_name=grid.spec.name, storage=f"sqlite:///{tmp_path / 'dsopt-0.db'}")
    first = study.trials[0]
    assert first.user_attrs["label"] == reference and first.user_attrs["launches"] == 0
    assert first.user_attrs["measured_by"] == "the FP32 reference run"
    assert first.values[1] == grid.entries[reference]["tokens_per_s"]
    assert reference not in run.launched and run.launched  # the seeds follow it
    # where the reference is itself the target, it is reached after 0 launches; the first launch is still made
    as_best = replace(grid, best_tokens_per_s=grid.entries[reference]["tokens_per_s"])
    (tmp_path / "again").mkdir()
    run = bench.run_dsopt(as_best, 0, tmp_path / "again")
    assert run.reached_at == 0 and len(run.launched) == 1
    (tmp_path / "without").mkdir()  # --without-reference: as the replays were before, no trial is the reference's
    bench.run_dsopt(grid, 0, tmp_path / "without", with_reference=False)
    study = optuna.load_study(study_name=grid.spec.name, storage=f"sqlite:///{tmp_path / 'without' / 'dsopt-0.db'}")
    assert not any("measured_by" in t.user_attrs for t in study.trials)
