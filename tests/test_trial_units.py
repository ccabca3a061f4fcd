"""Pure parts of the trial path: the launch plan, failure classification, aggregation, fidelity."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from launchers.cpu_memory import COUNT_FLAG, count_every_thread, start_cpu_profiler, stop_cpu_profiler
from launchers.local import LAUNCH_ID_VAR, build_launch_plan
from launchers.trial_rank import NonFiniteLoss, classify
from launchers.workload import SyntheticTokens, recomputed_blocks
from optimizer.trial_result import Outcome, loss_fidelity, summarize


def test_launch_plan_snapshot():
    plan = build_launch_plan(python="/venv/bin/python", ranks=2, cpu_ranks=True, master_port=29511,
                             plan_path=Path("/t/plan.json"), out_dir=Path("/t"), base_env={"PATH": "/bin"},
                             pythonpath=["/repo", "/studies"], cwd=Path("/repo"), cpu_count=2, launch_id="abc",
                             extensions_dir=Path("/venv/torch_extensions"))
    assert plan.argv == ("/venv/bin/python", "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
                         "2", "--master_addr", "127.0.0.1", "--master_port", "29511", "-m", "launchers.trial_rank",
                         "/t/plan.json", "/t")
    assert plan.env == {"PATH": "/bin", "PYTHONUNBUFFERED": "1", "PYTHONPATH": "/repo:/studies",
                        "OMP_NUM_THREADS": "1", "TORCHELASTIC_ERROR_FILE": "/t/elastic_error.json",
                        LAUNCH_ID_VAR: "abc", "TORCH_EXTENSIONS_DIR": "/venv/torch_extensions",
                        "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    assert plan.cwd == "/repo"


def test_gpu_plan_leaves_the_accelerator_alone():
    plan = build_launch_plan(python="py", ranks=4, cpu_ranks=False, master_port=1, plan_path=Path("p"),
                             out_dir=Path("o"), base_env={"PYTHONPATH": "/x"}, pythonpath=["/repo"], cwd=Path("."),
                             cpu_count=16, launch_id="id", extensions_dir=Path("/x/ext"))
    assert "DS_ACCELERATOR" not in plan.env and plan.env["PYTHONPATH"] == "/repo:/x"
    assert plan.env["OMP_NUM_THREADS"] == "4"


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (ValueError("Type fp16 is not supported on your device."), "unsupported"),  # DeepSpeed engine.py
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                      "you tried to allocate 1125899906842624 bytes."), "oom"),
        (torch.OutOfMemoryError("CUDA out of memory."), "oom"),
        (NonFiniteLoss("step 2: loss nan"), "nan"),
        (RuntimeError("something else"), "crash"),
        (ValueError("bad value"), "crash"),
    ],
)
def test_classification_is_by_exception(error, kind):
    assert classify(error) == kind


def test_cpu_live_tensor_peak_pairs_allocations():
    profiler = start_cpu_profiler()
    a = torch.empty(1_000_000, dtype=torch.uint8)
    b = torch.empty(2_000_000, dtype=torch.uint8)
    del a
    c = torch.empty(500_000, dtype=torch.uint8)
    peaks = stop_cpu_profiler(profiler)
    assert (peaks.peak, peaks.final) == (3_000_000, 2_500_000)
    del b, c


def test_cpu_live_tensor_peak_sees_frees_on_other_threads():
    # gloo frees a bucket on its worker thread once the collective's work object dies there; the profiler
    # records only the main thread, so address pairing keeps the block live and reads the next peak high.
    assert count_every_thread(False), "this torch's libc10 does not export " + COUNT_FLAG
    held = []
    profiler = start_cpu_profiler()
    with torch.profiler.record_function("phase.one"):
        held.append(torch.empty(4_000_000, dtype=torch.uint8))
        worker = threading.Thread(target=held.clear)  # the last reference dies on another thread
        worker.start()
        worker.join()
    later = torch.empty(1_000_000, dtype=torch.uint8)
    peaks = stop_cpu_profiler(profiler, ranges=("phase.one",))
    assert peaks.every_thread
    assert peaks.peak == 4_000_000
    assert peaks.final == 1_000_000  # the paired view would still count the freed 4 MB: 5_000_000
    assert peaks.until["phase.one"] == 4_000_000 and peaks.after["phase.one"] == 1_000_000
    del later


def _report(rank, **extra):
    base = {"rank": rank, "status": "ok", "losses": [2.0, 1.5, 1.0], "grad_norms": [1.0, 1.0, 1.0],
            "step_times_s": [0.2, 0.4], "peak_allocated_bytes": 100 + rank, "peak_reserved_bytes": None,
            "peak_rss_bytes": 1000}
    base.update(extra)
    return base


def test_summarize_ok_takes_the_slowest_rank_and_the_max_peak():
    result = summarize(rank_reports={0: _report(0), 1: _report(1, step_times_s=[0.3, 0.1])}, world_size=2,
                       returncode=0, timed_out=False, tokens_per_step=1000, reference_losses=[2.0, 1.5, 1.1],
                       log_tail="", wall_s=3.0)
    assert result.outcome is Outcome.OK
    assert result.step_time_s == pytest.approx(0.35)  # median of per-step max over ranks: 0.3, 0.4
    assert result.tokens_per_s == pytest.approx(1000 / 0.35)
    assert result.peak_memory_bytes == 101
    assert result.loss_fidelity == pytest.approx(0.1 / 1.1)


def test_summarize_failures():
    oom = {"rank": 1, "status": "oom", "error_type": "OutOfMemoryError", "message": "x"}
    assert summarize(rank_reports={1: oom}, world_size=2, returncode=1, timed_out=False, tokens_per_step=1,
                     reference_losses=None, log_tail="t", wall_s=1).outcome is Outcome.OOM
    assert summarize(rank_reports={0: _report(0)}, world_size=2, returncode=-9, timed_out=False, tokens_per_step=1,
                     reference_losses=None, log_tail="t", wall_s=1).outcome is Outcome.CRASH
    assert summarize(rank_reports={}, world_size=2, returncode=None, timed_out=True, tokens_per_step=1,
                     reference_losses=None, log_tail="t", wall_s=1).outcome is Outcome.TIMEOUT


def test_loss_fidelity():
    assert loss_fidelity([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert loss_fidelity([1.1, 2.0], [1.0, 2.0]) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        loss_fidelity([1.0], [1.0, 2.0])


def test_synthetic_tokens_depend_only_on_seed_step_and_index():
    data = SyntheticTokens(vocab_size=50, sequence_length=16, seed=3)
    again = SyntheticTokens(vocab_size=50, sequence_length=16, seed=3)
    assert torch.equal(data(4, [7, 8]), again(4, [7, 8]))
    assert torch.equal(data(4, [7, 8])[1], again(4, [8])[0])
    assert not torch.equal(data(4, [7]), data(5, [7]))


def test_recomputed_blocks_follow_the_knob():
    assert recomputed_blocks("full", 4) == {0, 1, 2, 3}
    assert recomputed_blocks("every_2", 5) == {1, 3}
    assert recomputed_blocks("none", 4) == recomputed_blocks("selective", 4) == set()


@pytest.mark.parametrize(
    "spec",
    [
        dict(layers=2, hidden_size=64, heads=4, kv_heads=4, ffn_size=256, vocab_size=100, tied_embeddings=True,
             attention="eager", mlp="gelu", norm="layernorm", bias=True, position_embedding="learned", dropout=True,
             max_positions=32),
        dict(layers=3, hidden_size=64, heads=8, kv_heads=2, ffn_size=96, vocab_size=100, tied_embeddings=False,
             attention="fused", mlp="swiglu", norm="rmsnorm", bias=False, position_embedding="rope", dropout=False,
             max_positions=32),
    ],
)
def test_the_workload_has_the_ledgers_parameter_count(spec):
    from launchers.workload import GPT
    from optimizer.specs import TransformerModel
    from optimizer.transformer import largest_tensor_parameters, parameter_count

    model = GPT(spec, checkpointing="none")
    assert sum(p.numel() for p in model.parameters()) == parameter_count(TransformerModel(**spec))
    assert max(p.numel() for p in model.parameters()) == largest_tensor_parameters(TransformerModel(**spec))
    tokens = torch.randint(0, spec["vocab_size"], (2, 9))
    assert torch.isfinite(model(tokens))


def test_reference_candidate_is_the_baseline_or_its_least_memory_fp32_variant(repo_root, tmp_path):
    import yaml

    from launchers.trial import reference_candidate
    from optimizer.errors import UserError
    from optimizer.ledger import evaluate
    from optimizer.specs import Precision, baseline_candidate
    from optimizer.study_file import load_study

    tiny = load_study(repo_root / "studies" / "cpu-tiny.yaml")
    assert reference_candidate(tiny) == baseline_candidate(tiny.training)
    demo = load_study(repo_root / "studies" / "demo-cpu.yaml")  # 3 MB per rank: the baseline does not fit
    chosen = reference_candidate(demo)
    assert chosen != baseline_candidate(demo.training) and chosen.precision is Precision.FP32
    assert chosen.micro_batch_size == demo.training.micro_batch_size
    assert evaluate(candidate=chosen, model=demo.model, hardware=demo.hardware, training=demo.training).fits
    raw = yaml.safe_load((repo_root / "studies" / "demo-cpu.yaml").read_text())
    raw["hardware"]["gpu_memory"] = "10 kB"
    (tmp_path / "none.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match="no FP32 configuration"):
        reference_candidate(load_study(tmp_path / "none.yaml"))


def test_stale_build_locks_are_cleared_but_fresh_ones_kept(tmp_path):
    import os
    import time

    from launchers.local import clear_stale_build_locks

    stale = tmp_path / "py311_cpu" / "fused_adam" / "lock"
    fresh = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert clear_stale_build_locks(tmp_path) == [stale]
    assert not stale.exists() and fresh.exists()
