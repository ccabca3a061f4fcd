"""One candidate in, one classified and measured :class:`~optimizer.results.trial_result.TrialResult` out.

Writes everything a trial used and produced under its folder (``studies/<name>/trials/<candidate>/``):
``ds_config.json`` (the builder's output, the study's ``nvme_path`` included), ``plan.json`` (what the ranks were
told: the same config, but NVMe offload swaps in the launch's own folder, :mod:`launchers.trial.nvme_folder`),
``log.txt`` (the launcher's and ranks' output), ``rank<r>.json`` (each rank's report) and
``result.json`` (the result, the library versions it ran under — :func:`optimizer.deepspeed.versions.installed_versions`
— and what :class:`launchers.trial.host_watch.HostWatch` saw of host memory, from which a launch the kernel's OOM
killer ended is ``oom_host``, not ``crash``). Loss fidelity compares against the study's FP32 reference
run — the baseline candidate (ZeRO 0, fp32, no checkpointing, the study's micro-batch) on the same global
batch and data, or, when the ledger says the baseline does not fit, its least-memory FP32 variant (see
:func:`reference_candidate`) — run once and cached in ``studies/<name>/reference.json`` under a key of
everything that determines it, the torch, DeepSpeed, transformers and dsopt versions included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from launchers.ops.op_needs import missing_here, missing_reason
from launchers.trial.host_watch import HostWatch
from launchers.trial.local import (
    LAUNCH_ID_VAR,
    LaunchPlan,
    build_launch_plan,
    execute,
    extensions_dir,
    free_port,
    log_tail,
)
from launchers.trial.node_share import WorkerSlot, gpu_slice, read_cpu_allowance, visible_gpus, worker_slot
from launchers.trial.nvme_folder import create_folders, per_launch_config, remove_folders
from launchers.trial.script_trial import script_command, script_plan, script_tokens_per_step, with_script_counts
from optimizer.deepspeed.config import build_ds_config
from optimizer.deepspeed.versions import installed_versions, warn_deepspeed_mismatch
from optimizer.ledger.core import evaluate
from optimizer.perf.throughput import predict_candidate
from optimizer.results.trial_result import OVER_BUDGET, Outcome, StopAbove, TrialResult, summarize, wrong_device
from optimizer.search.coordination import now_utc, worker_id
from optimizer.search.objective import RETRIED
from optimizer.study.constraints import invalid_reasons
from optimizer.study.errors import UserError
from optimizer.study.knobs import Candidate, FullCheckpointing, OffloadDevice, ZeroStage
from optimizer.study.specs import Accelerator, TransformerModel, baseline_candidate
from optimizer.study.study_file import StudySpec

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class ReferenceFailed(RuntimeError):
    """The FP32 reference run did not complete, so no fidelity can be computed."""

    def __init__(self, result: TrialResult) -> None:
        self.result = result
        super().__init__(f"the FP32 reference run ended with '{result.outcome}': {result.message}")


NOT_THE_MODEL = ("activations", "traced_activations", "inventory")
"""Spec fields that say how the ledger estimates, not what the ranks build."""


def model_dict(model: TransformerModel) -> dict[str, Any]:
    """The model spec as the JSON the ranks (and the tracer) build the model from; ``hf_config`` as a dict."""
    out = {f.name: (str(v) if hasattr(v, "value") else v)
           for f in dataclasses.fields(model) if f.name not in NOT_THE_MODEL for v in [getattr(model, f.name)]}
    out["hf_config"] = json.loads(model.hf_config) if model.hf_config is not None else None
    # absent unless set: a full fine-tune's spec (and every cache key) as before
    for name in ("peft", "frozen", "reference_model", "quantization", "sequences_per_sample", "lm_head"):
        out.pop(name)
    if model.peft is not None:
        out["peft"] = json.loads(model.peft)
    if model.quantization is not None:
        out["quantization"] = json.loads(model.quantization)
    if model.frozen:
        out["frozen"] = list(model.frozen)
    if model.reference_model:
        out["reference_model"] = True
    if model.lm_head != "logits":
        out["lm_head"] = model.lm_head
    if model.sequences_per_sample != 1:
        out["sequences_per_sample"] = model.sequences_per_sample
    return out


def trial_dir_for(study: StudySpec, candidate: Candidate) -> Path:
    """``studies/<name>/trials/<candidate>/``."""
    return study.output_dir / "trials" / candidate.folder_name()


def slurm_nodes_available() -> int:
    """Nodes of the SLURM allocation this process runs in (0 outside SLURM or without ``srun``)."""
    if not os.environ.get("SLURM_JOB_ID") or shutil.which("srun") is None:
        return 0
    try:
        return int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or "1")
    except ValueError:
        return 0


def multi_node_problem(study: StudySpec, *, slurm_nodes: int | None = None) -> str | None:
    """Why this process cannot start the study's multi-node trials (on ``slurm_nodes`` SLURM nodes, default
    one per node of the study), or None."""
    nodes = study.hardware.nodes
    if nodes == 1:
        return None
    available = slurm_nodes_available()
    if available >= (slurm_nodes or nodes):
        return None
    where = f"this SLURM allocation has {available} node(s)" if available else "this process is not inside a " \
        "SLURM allocation with srun"
    return (f"the study spans {nodes} nodes and {where}: multi-node trials are started with srun inside an "
            f"allocation of {nodes} nodes (dsopt slurm submit asks for them)")


def check_devices(study: StudySpec, *, slot: WorkerSlot | None = None) -> tuple[str, ...] | None:
    """Refuse (UserError) a study whose ranks this machine cannot provide; return this worker's GPU slice
    (``CUDA_VISIBLE_DEVICES`` entries for :func:`run_trial`'s ``gpus``), None for CPU ranks and for multi-node
    studies, whose worker holds whole nodes (SLURM sets each node's devices). ``slot`` (default:
    :func:`launchers.trial.node_share.worker_slot` from the environment) says which slice of the node's visible GPUs
    this worker takes when several share the node."""
    problem = multi_node_problem(study)
    if problem:
        raise UserError(source=str(study.path), key="hardware.nodes", why=problem)
    slot = slot or worker_slot(explicit=None, env=os.environ)
    if study.hardware.nodes > 1 and slot.index != 0:
        raise UserError(source=slot.source, key=str(slot.index), why=f"a worker of a {study.hardware.nodes}-node "
                        "study holds whole nodes; slots share one node between one-node studies' workers")
    if study.hardware.accelerator is Accelerator.CPU:
        return None
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < study.hardware.gpus_per_node:
        raise UserError(source=str(study.path), key="hardware.gpus_per_node",
                        why=f"the study asks for {study.hardware.gpus_per_node} CUDA device(s) per node; this "
                            f"machine has {count} (use accelerator: cpu for CPU ranks)")
    if study.hardware.nodes > 1:
        return None
    visible = visible_gpus(cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"), device_count=count)
    return gpu_slice(visible=visible, gpus_per_trial=study.hardware.gpus_per_node, slot=slot)


def rank_plan(*, study: StudySpec, candidate: Candidate) -> dict[str, Any]:
    """What every rank is told: the DeepSpeed config, the model, the data and the step counts (pure)."""
    assert isinstance(study.model, TransformerModel)
    config = build_ds_config(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)
    script = script_plan(study, candidate, config) if study.trial.command is not None else {}
    return {
        **script,
        "config": config,
        "model": model_dict(study.model),
        "entry_point": study.model.entry_point,
        "checkpointing": str(candidate.checkpointing),
        "construction": str(study.training.construction(candidate.zero_stage)),
        "sequence_length": study.training.sequence_length,
        "seed": study.trial.seed,
        "warmup_steps": study.trial.warmup_steps,
        "measured_steps": study.trial.measured_steps,
    }


def predicted_step_s(study: StudySpec, candidate: Candidate) -> float | None:
    """The hardware profile's predicted step time of ``candidate`` (None where the model has no figure)."""
    if not isinstance(study.model, TransformerModel):
        return None
    step = predict_candidate(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)
    return None if isinstance(step, str) else step.total_s


def trial_launch_plan(study: StudySpec, *, plan_path: Path, out_dir: Path, launch_id: str,
                      gpus: Sequence[str] | None, slurm_nodes: int | None = None,
                      rank_command: Sequence[str] | None = None) -> LaunchPlan:
    """The launch plan of one trial of ``study`` (:func:`launchers.trial.local.build_launch_plan`): its environment is
    also the one the study's DeepSpeed ops are built in (:mod:`launchers.study.op_prep`). ``rank_command``: the user's
    script (:mod:`launchers.trial.script_trial`), run in the study file's folder."""
    nodes = study.hardware.nodes
    return build_launch_plan(
        python=sys.executable, ranks=study.hardware.gpus_per_node,
        cpu_ranks=study.hardware.accelerator is Accelerator.CPU,
        master_port=free_port(), plan_path=plan_path, out_dir=out_dir, base_env=os.environ,
        pythonpath=[str(PACKAGE_ROOT), str(study.path.parent.resolve())],
        cwd=PACKAGE_ROOT if rank_command is None else study.path.parent.resolve(), rank_command=rank_command,
        cpu_count=read_cpu_allowance(), launch_id=launch_id, extensions_dir=extensions_dir(),
        parent_pid=os.getpid(), nodes=nodes, head_host=socket.gethostname() if nodes > 1 else "127.0.0.1",
        slurm_nodes=slurm_nodes, gpus=gpus if nodes == 1 else None, cpus_per_task=study.slurm.cpus_per_task,
    )


def run_trial(*, study: StudySpec, candidate: Candidate, trial_dir: Path | None = None,
              reference_losses: list[float] | None = None, ds_config: dict[str, Any] | None = None,
              slurm_nodes: int | None = None, step_s: float | None = None,
              gpus: Sequence[str] | None = None, stop_above: StopAbove | None = None,
              probe: Mapping[str, Any] | None = None, probe_timeout_s: float = 0.0) -> TrialResult:
    """Run ``candidate`` for real on this node's devices (CPU ranks when the study says ``cpu``), or across
    the nodes of the SLURM allocation when the study spans several (see
    :func:`launchers.trial.local.build_launch_plan`).

    ``ds_config`` replaces the built config (e.g. to train with an exported JSON file as it is);
    ``slurm_nodes`` packs a multi-node trial onto fewer SLURM nodes (tests on a one-node cluster); ``step_s`` is
    the predicted step time the launch's limit follows (default: the hardware profile's, :func:`predicted_step_s`;
    a study passes its calibrated prediction) — see :meth:`~optimizer.study.specs.TrialSettings.timeout_for`;
    ``gpus`` is this worker's GPU slice (:func:`check_devices`; None: every GPU the process sees). The ranks'
    threads follow the CPUs this process may really use (:func:`launchers.trial.node_share.read_cpu_allowance`).
    ``stop_above``: the per-rank peaks above which the ranks stop at once (an ``oom`` with ``stopped_at`` and what
    was measured until then; ``launchers/rank/trial_rank.py``); it goes into ``plan.json`` only, not into
    :func:`rank_plan`, whose output keys the FP32 reference (:func:`reference_key`), which never gets one.
    ``probe``: a probe's rank input (:func:`launchers.probe.machine.rank_input`) the ranks run once the trial's
    report is written (:func:`launchers.rank.probe_rank.after_trial`; ``probe_rank<k>.json`` in the trial's folder),
    the launch's limit ``probe_timeout_s`` longer; the result's ``wall_s`` is the trial's alone.
    A candidate that needs a DeepSpeed op this process's preparation found missing on this node
    (:mod:`launchers.study.op_prep`) is ``invalid``, never launched. NVMe offload swaps in a folder of the launch's own
    (:mod:`launchers.trial.nvme_folder`), removed once the launch ended.
    """
    reasons = invalid_reasons(candidate=candidate, model=study.model, hardware=study.hardware,
                              training=study.training)
    if reasons:
        return TrialResult(outcome=Outcome.INVALID, message="; ".join(reasons))
    if not isinstance(study.model, TransformerModel):
        return TrialResult(outcome=Outcome.INVALID, message="a seed-mode model has no shape to run")
    problem = multi_node_problem(study, slurm_nodes=slurm_nodes)
    if problem:
        return TrialResult(outcome=Outcome.INVALID, message=problem)
    accelerator = study.hardware.accelerator
    if why := missing_reason(candidate, accelerator=accelerator, missing=missing_here(accelerator)):
        return TrialResult(outcome=Outcome.INVALID, message=why)  # an op this node cannot build: never launched
    trial_dir = trial_dir or trial_dir_for(study, candidate)
    trial_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*trial_dir.glob("rank*.json"), *trial_dir.glob("probe_rank*.json")]:
        stale.unlink()
    plan = rank_plan(study=study, candidate=candidate)
    if ds_config is not None:
        plan["config"] = ds_config
    if stop_above is not None:  # after rank_plan: the reference's key stays what it was
        plan["stop_above"] = stop_above.to_plan()
    if probe is not None:  # likewise
        plan["probe"] = dict(probe)
    (trial_dir / "ds_config.json").write_text(json.dumps(plan["config"], indent=2) + "\n")
    launch_id = uuid.uuid4().hex
    plan["config"], nvme = per_launch_config(plan["config"], launch_id=launch_id, cwd=Path.cwd())  # its own swap
    (trial_dir / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    ranks = study.hardware.world_size
    rank_command = None if study.trial.command is None else script_command(
        study, candidate, launch_config=plan["config"], trial_dir=trial_dir)
    launch = trial_launch_plan(study, plan_path=trial_dir / "plan.json", out_dir=trial_dir, launch_id=launch_id,
                               gpus=gpus, slurm_nodes=slurm_nodes, rank_command=rank_command)
    log_path = trial_dir / "log.txt"
    record = {"launch_id": launch.env[LAUNCH_ID_VAR], "candidate": candidate.knobs(), "worker": worker_id(),
              "trial_dir": str(trial_dir)}
    timeout_s = study.trial.timeout_for(step_s if step_s is not None else predicted_step_s(study, candidate)) \
        + (probe_timeout_s if probe is not None else 0.0)
    try:
        create_folders(nvme)
    except OSError as err:
        return TrialResult(outcome=Outcome.CRASH, message=f"the launch's NVMe swap folder could not be made: {err}")
    append_launch_record(study, {**record, "event": "start", "at": now_utc().isoformat(), "timeout_s": timeout_s})
    warn_deepspeed_mismatch()
    try:
        with HostWatch() as host:  # the kernel's OOM kills and host memory in use while the ranks run
            run = execute(launch, timeout_s=timeout_s, log_path=log_path)
    finally:  # every rank is gone by now (execute leaves none): their swap files go too
        remove_folders(nvme)
    reports = {}
    for rank in range(ranks):
        path = trial_dir / f"rank{rank}.json"
        with contextlib.suppress(OSError, json.JSONDecodeError):  # no report: the rank died (crash, or oom_host)
            reports[rank] = json.loads(path.read_text())
    # every rank's trial report written and ok before the probe ran: a probe that then failed, hung or crashed at
    # exit fails the probe (collect_riding finds no report and the study probes on a launch of its own), not the trial
    measured = probe is not None and len(reports) == ranks and all(
        r.get("status") in (Outcome.OK.value, OVER_BUDGET) for r in reports.values())
    result = summarize(
        rank_reports=reports, world_size=ranks, returncode=0 if measured else run.returncode,
        timed_out=run.timed_out and not measured,
        tokens_per_step=study.model.rows(study.training.global_batch_size) * study.training.sequence_length
        if study.trial.command is None else script_tokens_per_step(study, reports),
        reference_losses=reference_losses, log_tail=log_tail(log_path), wall_s=run.wall_s,
        host_memory=host.evidence(),
    )
    if mismatch := wrong_device(reports, expected=str(study.hardware.accelerator)):
        result = dataclasses.replace(result, outcome=Outcome.CRASH, message=mismatch, tokens_per_s=None,
                                     log_tail=log_tail(log_path))
    result = with_script_counts(study, result, reports)
    if probe is not None:  # the probe's seconds are not the trial's
        result = dataclasses.replace(result, wall_s=max(0.0, result.wall_s - probe_seconds(trial_dir)))
    if result.outcome is Outcome.OK:
        result = dataclasses.replace(result, log_tail="")
    record_json = {**result_json(result), "versions": installed_versions(),
                   "host_memory": dataclasses.asdict(host.evidence())}
    (trial_dir / "result.json").write_text(json.dumps(record_json, indent=2) + "\n")
    append_launch_record(study, {**record, "event": "end", "at": now_utc().isoformat(),
                                 "outcome": result.outcome.value, "wall_s": round(run.wall_s, 3)})
    return result


def probe_seconds(trial_dir: Path) -> float:
    """Seconds the slowest rank's probe took in a trial's launch (``probe_rank<k>.json``; 0 without one)."""
    seconds = [0.0]
    for path in trial_dir.glob("probe_rank*.json"):
        with contextlib.suppress(OSError, ValueError, TypeError):
            seconds.append(float(json.loads(path.read_text()).get("seconds", 0.0)))
    return max(seconds)


def append_launch_record(study: StudySpec, record: dict[str, Any]) -> None:
    """Append one line to ``studies/<name>/launches.jsonl``: every real launch's start and end, by any worker
    (one ``O_APPEND`` write per line, so concurrent workers on one filesystem do not interleave lines)."""
    study.output_dir.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(study.output_dir / "launches.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def result_json(result: TrialResult) -> dict[str, Any]:
    """The result as JSON-ready data (integers for bytes)."""
    data = dataclasses.asdict(result)
    data["outcome"] = result.outcome.value
    data["peak_memory_bytes"] = result.peak_memory_bytes
    data["peak_reserved_bytes"] = result.peak_reserved_bytes
    data["peak_rss_bytes"] = result.peak_rss_bytes
    data["init_peak_memory_bytes"] = result.init_peak_memory_bytes
    data["init_s"] = result.init_s
    return data


def reference_candidate(study: StudySpec) -> Candidate:
    """The FP32 reference: the baseline if the ledger says it fits; else, of its FP32 variants that fit, the one with
    the shortest predicted step (a big model's reference can finish: its launch limit follows that prediction),
    then the least memory — ZeRO stages, offload and full recomputation only reorder floating-point reductions
    (≤ 1e-7 relative on cpu-tiny), so the losses are the baseline's. UserError if no FP32 configuration fits."""
    base = baseline_candidate(study.training)
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}
    if evaluate(candidate=base, **spec).fits:
        return base
    options = []
    for stage in ZeroStage:
        for optimizer in (OffloadDevice.NONE, OffloadDevice.CPU):
            for param in (OffloadDevice.NONE, OffloadDevice.CPU):
                for checkpointing in (base.checkpointing, FullCheckpointing()):
                    candidate = dataclasses.replace(base, zero_stage=stage, offload_optimizer=optimizer,
                                                    offload_param=param, checkpointing=checkpointing)
                    verdict = evaluate(candidate=candidate, **spec)
                    if verdict.fits and verdict.ledger is not None:
                        step = predicted_step_s(study, candidate)
                        options.append((math.inf if step is None else step, verdict.ledger.gpu_needed_bytes,
                                        candidate.label(), candidate))
    if not options:
        raise UserError(source=str(study.path), key="hardware", why="no FP32 configuration of the model fits, so "
                        "there is no FP32 reference to judge loss fidelity against")
    return min(options, key=lambda o: o[:3])[3]


def reference_key(study: StudySpec, *, versions: Mapping[str, str | None] | None = None) -> str:
    """Everything that determines the reference losses, hashed — the library versions included
    (``versions``, default :func:`optimizer.deepspeed.versions.installed_versions`: torch, DeepSpeed,
    transformers, dsopt),
    so that a reference measured under other versions is run again, not served."""
    plan = rank_plan(study=study, candidate=reference_candidate(study))
    payload = {"plan": plan, "ranks": study.hardware.gpus_per_node, "accelerator": str(study.hardware.accelerator),
               "versions": dict(installed_versions() if versions is None else versions)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def cached_reference_losses(study: StudySpec, *, name: str = "reference") -> list[float] | None:
    """The FP32 reference's losses cached for this study as it is now (``<name>.json`` under its key), or None:
    a launch is needed."""
    try:
        data = json.loads((study.output_dir / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != reference_key(study) or "losses" not in data:
        return None
    return list(data["losses"])


def reference_losses(study: StudySpec, *, gpus: Sequence[str] | None = None, probe: Mapping[str, Any] | None = None,
                     probe_timeout_s: float = 0.0, name: str = "reference") -> list[float]:
    """The FP32 reference losses, cached or from one run of :func:`reference_candidate` (``gpus``, ``probe``: as
    :func:`run_trial`), kept as ``<name>.json`` and ``<name>/`` (one per micro-batch: ``reference_batches``)."""
    cached = cached_reference_losses(study, name=name)
    if cached is not None:
        return cached
    candidate = reference_candidate(study)
    result = run_trial(study=study, candidate=candidate, trial_dir=study.output_dir / name, gpus=gpus, probe=probe,
                       probe_timeout_s=probe_timeout_s)
    for _ in range(study.trial.retries):  # maybe transient, as a trial's crash or timeout (objective.RETRIED): a rank
        if result.outcome not in RETRIED:  # that aborted at exit after its report ("terminate called without an
            break                          # active exception", seen once on CPU ranks) stopped the whole study
        result = run_trial(study=study, candidate=candidate, trial_dir=study.output_dir / name, gpus=gpus,
                           probe=probe, probe_timeout_s=probe_timeout_s)
    if result.outcome is not Outcome.OK:
        raise ReferenceFailed(result)
    keep_reference(study, name=name, candidate=candidate, losses=result.losses, drew=result.draws_random)
    return list(result.losses)


def keep_reference(study: StudySpec, *, name: str, candidate: Candidate, losses: Sequence[float],
                   drew: bool = False) -> None:
    """Cache ``losses`` as the study's FP32 reference ``<name>.json`` under its key, replaced whole; ``drew``: its
    training drew random numbers (``draws_random``, :func:`launchers.trial.reference_batches.reference_drew`)."""
    cache = study.output_dir / f"{name}.json"
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"key": reference_key(study), "versions": installed_versions(), "draws_random": drew,
                               "candidate": candidate.knobs(), "losses": list(losses)}, indent=2) + "\n")
    tmp.replace(cache)
