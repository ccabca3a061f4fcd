"""Pure parts of the trial path: the launch plan, failure classification, aggregation, fidelity."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
import torch
from trial_fixtures import FAR, KILLED, NEAR, rank_report

from launchers.measure.cpu_memory import COUNT_FLAG, count_every_thread, start_cpu_profiler, stop_cpu_profiler
from launchers.models.blocks import recomputed_blocks
from launchers.models.builtin import SyntheticTokens
from launchers.rank.trial_rank import NonFiniteLoss, classify
from launchers.trial.local import LAUNCH_ID_VAR, build_launch_plan
from optimizer.results.host_oom import HostMemoryEvidence
from optimizer.results.trial_result import Outcome, loss_fidelity, summarize


def test_launch_plan_snapshot():
    plan = build_launch_plan(python="/venv/bin/python", ranks=2, cpu_ranks=True, master_port=29511,
                             plan_path=Path("/t/plan.json"), out_dir=Path("/t"), base_env={"PATH": "/bin"},
                             pythonpath=["/repo", "/studies"], cwd=Path("/repo"), cpu_count=2, launch_id="abc",
                             extensions_dir=Path("/venv/torch_extensions"))
    assert plan.argv == ("/venv/bin/python", "-m", "launchers.process.collector", "torch.distributed.run", "--nnodes",
                         "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", "29511", "-m",
                         "launchers.rank.trial_rank", "/t/plan.json", "/t")
    assert plan.env == {"PATH": "/bin", "PYTHONUNBUFFERED": "1", "PYTHONPATH": "/repo:/studies",
                        "OMP_NUM_THREADS": "1", "TORCHELASTIC_ERROR_FILE": "/t/elastic_error.json",
                        LAUNCH_ID_VAR: "abc", "TORCH_EXTENSIONS_DIR": "/venv/torch_extensions",
                        "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    assert plan.cwd == "/repo"


def test_gpu_plan_sets_the_accelerator_even_against_an_inherited_one():
    # issue 24: a shell that ran a CPU study keeps DS_ACCELERATOR=cpu; a GPU study's ranks must still be CUDA ranks
    plan = build_launch_plan(python="py", ranks=4, cpu_ranks=False, master_port=1, plan_path=Path("p"),
                             out_dir=Path("o"), base_env={"PYTHONPATH": "/x", "DS_ACCELERATOR": "cpu"},
                             pythonpath=["/repo"], cwd=Path("."), cpu_count=16, launch_id="id",
                             extensions_dir=Path("/x/ext"), gpus=["0", "1"])
    assert plan.env["DS_ACCELERATOR"] == "cuda" and plan.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert plan.env["PYTHONPATH"] == "/repo:/x"
    assert plan.env["OMP_NUM_THREADS"] == "4"
    cpu = build_launch_plan(python="py", ranks=2, cpu_ranks=True, master_port=1, plan_path=Path("p"),
                            out_dir=Path("o"), base_env={"DS_ACCELERATOR": "cuda"}, pythonpath=[], cwd=Path("."),
                            cpu_count=2, launch_id="id", extensions_dir=Path("/x/ext"))
    assert cpu.env["DS_ACCELERATOR"] == "cpu"


def test_a_rank_on_another_device_than_the_studys_is_a_trial_error():
    from optimizer.results.trial_result import wrong_device

    cuda_ranks = {0: {"device": "cuda"}, 1: {"device": "cuda"}}
    assert wrong_device(cuda_ranks, expected="cuda") is None
    assert wrong_device({0: {"device": "cuda"}, 1: {"status": "crash"}}, expected="cuda") is None  # names none
    why = wrong_device({0: {"device": "cuda"}, 1: {"device": "cpu"}}, expected="cuda")
    assert why is not None and why.startswith("rank 1 ran on cpu") and "hardware.accelerator is cuda" in why


CPU_ALLOCATOR_OOM = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                                 "memory: you tried to allocate 1125899906842624 bytes. Error code 12 (Cannot "
                                 "allocate memory)")  # c10/core/impl/alloc_cpu.cpp
NCCL_ERROR = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, {what} (run with NCCL_DEBUG=INFO "
              "for details), NCCL version 2.27.3\n{detail}\nLast error:\n{last}")  # c10d getNcclErrorDetailStr


def _nccl(what: str, detail: str, last: str) -> RuntimeError:
    return torch.distributed.DistBackendError(NCCL_ERROR.format(what=what, detail=detail, last=last))


def _accelerator_error(text: str, code: int) -> RuntimeError:
    """What C10_CUDA_CHECK raises from torch 2.8 (torch/csrc/Exceptions.cpp sets ``error_code``)."""
    error = torch.AcceleratorError(text)
    error.error_code = code
    return error


def _raised_by_pin_memory() -> RuntimeError:
    def pin_memory(tensor):  # DeepSpeed accelerator/cuda_accelerator.py: ``return tensor.pin_memory()``
        raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")
    try:
        pin_memory(None)
    except RuntimeError as error:
        return error
    raise AssertionError("unreachable")


def _raised_from(cause: BaseException) -> RuntimeError:
    try:
        raise RuntimeError("the engine could not be set up") from cause
    except RuntimeError as error:
        return error


NCCL_CUDA = "unhandled cuda error", "ncclUnhandledCudaError: Call to CUDA function failed."
NCCL_SYSTEM = "unhandled system error", "ncclSystemError: System call (e.g. socket, malloc) or external library " \
    "call failed or device error. "


@pytest.mark.parametrize(
    ("error", "kind", "cpu_ranks"),
    [
        (ValueError("Type fp16 is not supported on your device."), "unsupported", True),  # DeepSpeed engine.py
        (CPU_ALLOCATOR_OOM, "oom", True),  # CPU ranks: the host is the device
        (CPU_ALLOCATOR_OOM, "oom_host", False),  # CUDA ranks: offloaded states on the host ran out
        (torch.OutOfMemoryError("CUDA out of memory."), "oom", True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                "79.10 GiB of which 1.2 GiB is free."), "oom", False),  # CUDACachingAllocator.cpp
        (NonFiniteLoss("step 2: loss nan"), "nan", True),
        (RuntimeError("something else"), "crash", True),
        (ValueError("bad value"), "crash", True),
        # cuBLAS handle / workspace allocation (ATen/cuda/Exceptions.h TORCH_CUDABLAS_CHECK)
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), "oom", False),
        (RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb)`"),
         "crash", False),
        # C10_CUDA_CHECK: a RuntimeError before torch 2.8, torch.AcceleratorError with error_code after
        (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), "oom",
         False),
        (_accelerator_error("CUDA error: out of memory", 2), "oom", False),  # cudaErrorMemoryAllocation
        (_accelerator_error("CUDA error: an illegal memory access was encountered", 700), "crash", False),
        (RuntimeError("CUDA driver error: out of memory"), "oom", False),  # c10/cuda/driver_api.h
        (RuntimeError("cudaErrorMemoryAllocation: out of memory"), "oom", False),
        # NCCL's last error after a CUDA allocation failed (checks.h CUDACHECK, cudawrap.h CUCHECK)
        (_nccl(*NCCL_CUDA, "Cuda failure 'out of memory'"), "oom", False),
        (_nccl(*NCCL_CUDA, "Cuda failure 2 'out of memory'"), "oom", False),
        (_nccl(*NCCL_CUDA, "Cuda failure 1 'invalid argument'"), "crash", False),
        # ... and after a host allocation failed (alloc.h ncclCalloc / ncclCudaHostCalloc, checks.h SYSCHECK)
        (_nccl(*NCCL_SYSTEM, "Failed to malloc 8388608 bytes"), "oom_host", False),
        (_nccl(*NCCL_CUDA, "Failed to CUDA host alloc 8388608 bytes"), "oom_host", False),
        (_nccl(*NCCL_SYSTEM, "Call to posix_memalign failed: Cannot allocate memory"), "oom_host", False),
        (_nccl(*NCCL_SYSTEM, "socketStartConnect: Connect to 10.0.0.2<43215> failed : Connection refused"), "crash",
         False),
        # pinned host memory: cudaHostAlloc fails with the device's text; where it was raised says host
        (_raised_by_pin_memory(), "oom_host", False),
        (MemoryError(), "oom_host", False),
        (MemoryError(), "oom", True),
        (OSError(errno.ENOMEM, "Cannot allocate memory"), "oom_host", False),  # fork / mmap: ENOMEM
        (OSError(errno.ENOENT, "No such file or directory"), "crash", False),
        (_raised_from(torch.OutOfMemoryError("CUDA out of memory.")), "oom", False),  # raise ... from the OOM
        (_raised_from(ValueError("bad value")), "crash", False),
    ],
)
def test_classification_is_by_exception(error, kind, cpu_ranks):
    assert classify(error, cpu_ranks=cpu_ranks) == kind


def test_classification_defaults_to_the_ranks_the_trial_runs_on(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # as launchers.trial.local sets it for CPU ranks
    assert classify(CPU_ALLOCATOR_OOM) == "oom"


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


def test_summarize_ok_takes_the_slowest_rank_and_the_max_peak():
    result = summarize(rank_reports={0: rank_report(0), 1: rank_report(1, step_times_s=[0.3, 0.1])}, world_size=2,
                       returncode=0, timed_out=False, tokens_per_step=1000, reference_losses=[2.0, 1.5, 1.1],
                       log_tail="", wall_s=3.0)
    assert result.outcome is Outcome.OK
    assert result.step_time_s == pytest.approx(0.35)  # median of per-step max over ranks: 0.3, 0.4
    assert result.step_time_range_s == pytest.approx((0.3, 0.4))  # the spread the median hides
    assert result.tokens_per_s == pytest.approx(1000 / 0.35)
    assert result.peak_memory_bytes == 101
    assert result.loss_fidelity == pytest.approx(0.1 / 1.1)


def test_summarize_failures():
    oom = {"rank": 1, "status": "oom", "error_type": "OutOfMemoryError", "message": "x"}
    assert summarize(rank_reports={1: oom}, world_size=2, returncode=1, timed_out=False, tokens_per_step=1,
                     reference_losses=None, log_tail="t", wall_s=1).outcome is Outcome.OOM
    assert summarize(rank_reports={0: rank_report(0)}, world_size=2, returncode=-9, timed_out=False, tokens_per_step=1,
                     reference_losses=None, log_tail="t", wall_s=1).outcome is Outcome.CRASH
    assert summarize(rank_reports={}, world_size=2, returncode=None, timed_out=True, tokens_per_step=1,
                     reference_losses=None, log_tail="t", wall_s=1).outcome is Outcome.TIMEOUT




def _summarize_killed(reports, *, returncode, host):
    return summarize(rank_reports=reports, world_size=2, returncode=returncode, timed_out=False, tokens_per_step=1,
                     reference_losses=None, log_tail="t", wall_s=1, host_memory=host)


def test_a_sigkill_with_host_memory_near_its_limit_is_oom_host():
    result = _summarize_killed({}, returncode=-9, host=NEAR)
    assert result.outcome is Outcome.OOM_HOST
    assert "ranks without a report: [0, 1]" in result.message and "97%" in result.message
    assert _summarize_killed({}, returncode=137, host=NEAR).outcome is Outcome.OOM_HOST  # a shell's 128 + 9


def test_a_sigkill_without_memory_evidence_is_a_crash():
    assert _summarize_killed({}, returncode=-9, host=FAR).outcome is Outcome.CRASH
    assert _summarize_killed({}, returncode=-9, host=None).outcome is Outcome.CRASH
    unreadable = HostMemoryEvidence(oom_kills=None)
    assert _summarize_killed({}, returncode=-9, host=unreadable).outcome is Outcome.CRASH


def test_the_kernels_oom_kill_count_makes_a_killed_rank_oom_host():
    # torchrun exits 1 when the OOM killer SIGKILLs a rank (ChildFailedError), so the count decides
    assert _summarize_killed({0: rank_report(0)}, returncode=1, host=KILLED).outcome is Outcome.OOM_HOST
    assert _summarize_killed({0: rank_report(0)}, returncode=1, host=NEAR).outcome is Outcome.CRASH  # no signal seen
    # the surviving peer crashed on the broken collective: the kill is still the cause
    peer = {"rank": 0, "status": "crash", "error_type": "DistBackendError", "message": "Connection closed by peer"}
    assert _summarize_killed({0: peer}, returncode=1, host=KILLED).outcome is Outcome.OOM_HOST
    assert _summarize_killed({0: peer}, returncode=1, host=FAR).outcome is Outcome.CRASH
    # a rank's own classified failure stands; every rank reported: nobody was killed
    oom = {"rank": 0, "status": "oom", "error_type": "OutOfMemoryError", "message": "x"}
    assert _summarize_killed({0: oom}, returncode=1, host=KILLED).outcome is Outcome.OOM
    both = {0: rank_report(0), 1: rank_report(1)}
    assert _summarize_killed(both, returncode=0, host=KILLED).outcome is Outcome.OK


def test_a_launch_stopped_at_its_timeout_after_an_oom_kill_is_oom_host():
    def timed_out(host):
        return summarize(rank_reports={}, world_size=2, returncode=None, timed_out=True, tokens_per_step=1,
                         reference_losses=None, log_tail="t", wall_s=1, host_memory=host).outcome

    assert timed_out(KILLED) is Outcome.OOM_HOST  # the kill, not the hang that followed it, is the cause
    assert timed_out(NEAR) is Outcome.TIMEOUT  # our own SIGKILLs at the timeout are not the kernel's


def test_a_rank_reporting_a_host_allocation_failure_is_oom_host():
    host = {"rank": 1, "status": "oom_host", "error_type": "RuntimeError", "message": "Cannot allocate memory"}
    assert _summarize_killed({1: host}, returncode=1, host=None).outcome is Outcome.OOM_HOST


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
    from launchers.models.builtin import GPT
    from optimizer.ledger.transformer import largest_tensor_parameters, parameter_count
    from optimizer.study.specs import TransformerModel

    model = GPT(spec, checkpointing="none")
    assert sum(p.numel() for p in model.parameters()) == parameter_count(TransformerModel(**spec))
    assert max(p.numel() for p in model.parameters()) == largest_tensor_parameters(TransformerModel(**spec))
    tokens = torch.randint(0, spec["vocab_size"], (2, 9))
    assert torch.isfinite(model(tokens))


def test_reference_candidate_is_the_baseline_or_its_least_memory_fp32_variant(repo_root, tmp_path):
    import yaml

    from launchers.trial.run import reference_candidate
    from optimizer.ledger.core import evaluate
    from optimizer.study.errors import UserError
    from optimizer.study.specs import Precision, baseline_candidate
    from optimizer.study.study_file import load_study

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




def test_the_norm_where_deepspeed_gives_none_is_every_gradients_norm():
    # issue 24: only where the engine's optimizer keeps no norm (engine.py:3518-3519), and per tensor in its own dtype
    from types import SimpleNamespace

    import torch

    from launchers.rank.trial_rank import _grad_norm, _reports_grad_norm

    layer = torch.nn.Linear(3, 2)
    layer.weight.grad = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 0.0]])
    layer.bias.grad = torch.tensor([0.0, 12.0])
    assert _grad_norm(layer) == 13.0  # sqrt(9 + 16 + 144)
    assert _grad_norm(torch.nn.Linear(3, 2)) is None  # no gradient yet
    assert _reports_grad_norm(SimpleNamespace(optimizer=SimpleNamespace(_global_grad_norm=None)))  # ZeRO, FP16, BF16
    assert not _reports_grad_norm(SimpleNamespace(optimizer=torch.optim.Adam(layer.parameters())))  # stage 0 fp32
