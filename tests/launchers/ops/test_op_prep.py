"""Ops before clocks (launchers/ops/op_needs.py, op_prep.py, op_load.py): which DeepSpeed ops each candidate needs, the
one build per node outside the trials' clocks, and a missing op: one message, its candidates invalid, never
launched, never a crash — exit 2 when it rules out everything. The build subprocess is replaced by one that writes
its report (no DeepSpeed); DeepSpeed's real builders are tested in tests/real/deepspeed/test_op_build_real.py."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
from ops_study import ops_study

import launchers.study.op_prep as op_prep
from launchers.ops.op_load import load_op
from launchers.ops.op_needs import ASYNC_IO, CPU_ADAM, FUSED_ADAM, SHM_COMM, missing_here, note_missing, ops_for
from launchers.trial.local import Execution
from optimizer.study.errors import UserError
from optimizer.study.knobs import OffloadDevice, ZeroStage
from optimizer.study.specs import Accelerator, baseline_candidate

ROOT = Path(__file__).resolve().parents[3]
NONE, CPU, NVME = OffloadDevice.NONE, OffloadDevice.CPU, OffloadDevice.NVME


@pytest.fixture(autouse=True)
def _nothing_missing():
    """What a test's preparation found missing does not leak into the next test."""
    yield
    for accelerator in Accelerator:
        note_missing(accelerator, {})


@pytest.mark.parametrize(("accelerator", "optimizer", "param", "ops"), [
    (Accelerator.CPU, NONE, NONE, (SHM_COMM, FUSED_ADAM)),  # plain Adam on CPU ranks: the CPU FusedAdamBuilder
    (Accelerator.CPU, CPU, NONE, (SHM_COMM, CPU_ADAM)),
    (Accelerator.CPU, NVME, NONE, (SHM_COMM, CPU_ADAM, ASYNC_IO)),
    (Accelerator.CPU, NONE, NVME, (SHM_COMM, FUSED_ADAM, ASYNC_IO)),
    (Accelerator.CUDA, NONE, NONE, (FUSED_ADAM,)),  # nvcc; no shared-memory collectives on CUDA (NCCL)
    (Accelerator.CUDA, CPU, CPU, (CPU_ADAM,)),
    (Accelerator.CUDA, NVME, NVME, (CPU_ADAM, ASYNC_IO)),
])
def test_the_ops_each_candidate_needs(accelerator, optimizer, param, ops, tiny):
    candidate = dataclasses.replace(baseline_candidate(tiny.training), zero_stage=ZeroStage.PARAMETERS,
                                    offload_optimizer=optimizer, offload_param=param)
    assert ops_for(candidate, accelerator=accelerator) == ops


@pytest.mark.parametrize(("nvme", "offload", "accelerator", "names"), [
    (False, ("none", "cpu"), "cpu", ["deepspeed_shm_comm", "fused_adam", "cpu_adam"]),
    (False, ("none",), "cpu", ["deepspeed_shm_comm", "fused_adam"]),
    (True, ("none", "cpu", "nvme"), "cpu", ["deepspeed_shm_comm", "fused_adam", "cpu_adam", "async_io"]),
    (True, ("cpu",), "cuda", ["fused_adam", "cpu_adam", "async_io"]),  # fused_adam: the FP32 reference's
])
def test_the_ops_a_search_space_needs(tmp_path, nvme, offload, accelerator, names):
    from launchers.ops.op_needs import ops_needed
    from launchers.trial.run import reference_candidate

    spec = ops_study(tmp_path, nvme=nvme, offload_optimizer=offload, accelerator=accelerator)
    wanted = ops_needed([*op_prep.study_candidates(spec), reference_candidate(spec)],
                        accelerator=spec.hardware.accelerator)
    assert [op.name for op in wanted] == names


class _Builder:
    """DeepSpeed's OpBuilder as the child uses it: ``is_compatible`` warns (``warning`` keeps the last in
    ``error_log``), ``load`` builds or raises."""

    def __init__(self, *, compatible=True, fails=None, warnings=()):
        self.compatible, self.fails, self.warnings, self.loads = compatible, fails, warnings, 0

    def warning(self, msg):
        self.error_log = msg

    def is_compatible(self, verbose=False):
        for msg in self.warnings:
            self.warning(msg)
        return self.compatible

    def load(self, verbose=False):
        self.loads += 1
        if self.fails:
            raise self.fails


def test_the_child_reports_a_builder_that_is_incompatible_or_fails_to_load():
    aio = _Builder(compatible=False, warnings=("async_io requires the dev libaio .so object and headers",
                                               "If libaio is already installed, try setting CFLAGS and LDFLAGS"))
    adam = _Builder(fails=RuntimeError("Error building extension 'cpu_adam'\nc++: not found"))
    ok = _Builder()
    builders = {"AsyncIOBuilder": aio, "CPUAdamBuilder": adam, "FusedAdamBuilder": ok, "ShareMemCommBuilder": aio}
    create = builders.get
    missing = load_op("AsyncIOBuilder", optional=False, create=create)
    assert missing["status"] == "missing" and "is_compatible() says no" in missing["why"]
    assert "requires the dev libaio" in missing["why"] and "CFLAGS" in missing["why"]  # every warning, not the last
    assert aio.loads == 0  # never built where DeepSpeed itself says it cannot be
    failed = load_op("CPUAdamBuilder", optional=False, create=create)
    assert failed["status"] == "missing" and "Error building extension 'cpu_adam'" in failed["why"]
    assert load_op("FusedAdamBuilder", optional=False, create=create)["status"] == "ready" and ok.loads == 1
    assert load_op("ShareMemCommBuilder", optional=True, create=create)["status"] == "skipped"  # gloo alone
    assert load_op("NoSuchBuilder", optional=True, create=create)["status"] == "skipped"
    assert load_op("NoSuchBuilder", optional=False, create=create)["status"] == "missing"


def _fake_build(monkeypatch, tmp_path: Path, statuses: dict[str, str], calls: list | None = None):
    """Replace the build subprocess: it reports ``statuses`` (builder → status) as launchers.ops.op_load writes it; the
    node lock in a TORCH_EXTENSIONS_DIR of the test's own."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))

    def execute(plan, *, timeout_s, log_path):
        out = Path(plan.argv[plan.argv.index("launchers.ops.op_load") + 1])
        builders = [name.partition(":")[0] for name in plan.argv[plan.argv.index("launchers.ops.op_load") + 2:]]
        if calls is not None:
            calls.append({"env": plan.env, "builders": builders, "timeout_s": timeout_s})
        report = {b: {"status": statuses.get(b, "ready"), "load_s": 1.5,
                      "why": "" if statuses.get(b, "ready") == "ready" else f"simulated: {b} cannot be built"}
                  for b in builders}
        out.write_text(json.dumps(report))
        log_path.write_text("builders' output\n")
        return Execution(returncode=0, timed_out=False, wall_s=2.0)

    monkeypatch.setattr(op_prep, "execute", execute)


def test_one_build_before_the_trials_in_the_trials_environment(tmp_path, monkeypatch):
    from launchers.trial.local import extensions_dir

    spec = ops_study(tmp_path)
    calls: list = []
    said: list[str] = []
    _fake_build(monkeypatch, tmp_path, {}, calls)
    assert op_prep.prepare_ops(spec=spec, gpus=None, worker="w0", say=said.append) is spec  # nothing dropped
    (call,) = calls
    assert call["builders"] == ["ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder"]
    assert call["env"]["DS_ACCELERATOR"] == "cpu" and call["env"]["TORCH_EXTENSIONS_DIR"] == str(extensions_dir())
    assert call["timeout_s"] == op_prep.OP_BUILD_TIMEOUT_S  # its own limit, not a trial's
    assert "outside any trial's clock" in said[-1] and "fused_adam 1.5 s" in said[-1]
    assert (extensions_dir() / op_prep.LOCK_NAME).read_text().strip() == "w0"


def test_a_missing_op_is_one_message_and_its_candidates_are_invalid_not_launched(tmp_path, monkeypatch):
    from launchers.trial import run as trial

    spec = ops_study(tmp_path, nvme=True, offload_optimizer=("none", "cpu", "nvme"))
    said: list[str] = []
    _fake_build(monkeypatch, tmp_path, {"AsyncIOBuilder": "missing"})
    narrowed = op_prep.prepare_ops(spec=spec, gpus=None, worker="w0", say=said.append)
    (message,) = [line for line in said if "async_io" in line and "rules out" in line]
    nvme = [c for c in op_prep.study_candidates(spec) if NVME in (c.offload_optimizer, c.offload_param)]
    assert f"rules out {len(nvme)} of {len(op_prep.study_candidates(spec))} candidate(s)" in message
    assert "simulated: AsyncIOBuilder cannot be built" in message and "libaio" in message
    assert nvme[0].label() in message and "never launched" in message
    values = dict(narrowed.search_space.values)
    assert values["offload_optimizer"] == (NONE, CPU) and values["offload_param"] == (NONE,)
    assert set(op_prep.study_candidates(narrowed)) == set(op_prep.study_candidates(spec)) - set(nvme)
    assert "async_io" in missing_here(Accelerator.CPU)

    def execute(*args, **kwargs):
        raise AssertionError("a candidate that needs a missing op was launched")

    monkeypatch.setattr(trial, "execute", execute)
    result = trial.run_trial(study=narrowed, candidate=nvme[0], trial_dir=tmp_path / "t")
    assert result.outcome.value == "invalid" and "async_io" in result.message
    assert not (tmp_path / "t").exists()


def test_an_op_that_rules_out_every_candidate_stops_the_command_with_exit_2(tmp_path, monkeypatch, capsys):
    from optimizer.cli import main

    spec = ops_study(tmp_path, offload_optimizer=("none", "cpu"))
    _fake_build(monkeypatch, tmp_path, {"FusedAdamBuilder": "missing", "CPUAdamBuilder": "missing"})
    with pytest.raises(UserError, match="every one of the"):
        op_prep.prepare_ops(spec=spec, gpus=None, worker="w0", say=lambda text: None)
    assert main(["study", "run", str(spec.path), "--n-trials", "1"]) == 2
    err = capsys.readouterr().err
    (last,) = [line for line in err.splitlines() if line.startswith("dsopt: error:")]
    assert "fused_adam" in last and "cpu_adam" in last and "every one of the" in last
    assert not (spec.output_dir / "reference").exists()  # the FP32 reference never started


def test_a_missing_op_the_reference_needs_stops_before_it(tmp_path, monkeypatch):
    spec = ops_study(tmp_path, offload_optimizer=("none", "cpu"))  # the reference: z0 fp32 without offload
    _fake_build(monkeypatch, tmp_path, {"FusedAdamBuilder": "missing"})
    with pytest.raises(UserError, match="the FP32 reference"):
        op_prep.prepare_ops(spec=spec, gpus=None, worker="w0", say=lambda text: None)


def test_a_study_records_a_proposal_that_needs_a_missing_op_as_invalid(tmp_path, monkeypatch):
    import optuna

    from launchers.study.study_run import run_study
    from launchers.trial import run as trial
    from optimizer.search.objective import DIRECTIONS
    from optimizer.search.space import branches, distribution_params

    spec = ops_study(tmp_path, nvme=True, offload_optimizer=("none", "cpu", "nvme"))
    nvme = next(c for c in op_prep.study_candidates(spec) if c.offload_param is NVME)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.create_study(study_name=spec.name, storage=storage, directions=list(DIRECTIONS)).enqueue_trial(
        distribution_params(nvme, branches(spec)), user_attrs={"enqueued_by": "test"})  # the sampler's proposal
    _fake_build(monkeypatch, tmp_path, {"AsyncIOBuilder": "missing"})
    launched: list[str] = []

    def execute(plan, *, timeout_s, log_path):  # stands for the ranks: a crash, without starting any
        config = json.loads((log_path.parent / "plan.json").read_text())["config"]
        assert config["zero_optimization"].get("offload_param", {}).get("device") != "nvme", "launched async_io"
        launched.append(log_path.parent.name)
        return Execution(returncode=1, timed_out=False, wall_s=0.0)

    monkeypatch.setattr(trial, "execute", execute)
    study = run_study(spec=spec, storage=storage, n_trials=1, timeout_s=None, reference=lambda: [1.0, 1.0])
    (frozen,) = [t for t in study.trials if t.user_attrs.get("label") == nvme.label()]
    assert frozen.state is optuna.trial.TrialState.FAIL
    assert frozen.user_attrs["outcome"] == "invalid" and "async_io" in frozen.user_attrs["message"]
    assert frozen.user_attrs["launches"] == 0  # nothing started: --n-trials 1 is still to be spent, and was
    assert launched and sum(t.user_attrs.get("launches", 0) for t in study.trials) == 2  # a crash, retried once


def test_the_second_worker_of_a_node_waits_for_the_first(tmp_path):
    lock = tmp_path / "ext" / op_prep.LOCK_NAME
    said: list[str] = []
    entered = threading.Event()

    def second():
        with op_prep.node_lock(lock, holder="w1", say=said.append, doing="building DeepSpeed ops") as waited_s:
            said.append(f"w1 in after {waited_s:.2f} s")
            entered.set()

    with op_prep.node_lock(lock, holder="w0", say=said.append, doing="building DeepSpeed ops"):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        assert not entered.is_set()
    thread.join(5)
    assert said[0].startswith("waiting for w0 to finish building DeepSpeed ops")
    assert said[1].startswith("w1 in after") and float(said[1].split()[3]) >= 0.2
    assert lock.read_text().strip() == "w1"
