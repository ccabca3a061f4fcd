"""Probe this machine's kernels at a study's shapes: start the ranks, merge their timings, keep them per machine.

:func:`with_probe` gives the study its probe (:attr:`optimizer.study.specs.HardwareSpec.probe`): from the cache when
this machine with these library versions has probed these shapes before, else by :func:`run_probe` — one launch
of the study's ranks per node (torchrun, as a trial's, :func:`launchers.trial.local.build_launch_plan`) running
:mod:`launchers.rank.probe_rank` on :func:`optimizer.perf.probe_plan.probe_plan`'s list. A study whose FP32
reference is launched anyway has its ranks probe at the end of that launch instead (:func:`riding_input`,
:func:`collect_riding`): the same operations, without a launch of their own. The ranks' timings are
merged per operation: the slowest rank's median (a step waits for its slowest rank), the fastest and slowest
round of any rank. A study on CUDA ranks cannot be probed on a machine without CUDA (a laptop planning a GPU
study): :class:`ProbeUnavailable` says so and the profile's figures stay.

The cache (``probe/`` in :func:`launchers.trace.cache_dir.cache_dir`) is keyed by the machine (host name, CPU
model, the GPUs this worker sees), the library versions, the probe's code and the plan: another study of the same
shapes on the same machine reuses it; a new driver or another node probes again.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from launchers.ops.build_locks import node_lock
from launchers.trace.cache_dir import cache_dir, source_digest
from launchers.trace.inventory import adapted_inventory, with_inventory
from launchers.trace.json_cache import KeyedJsonStore
from launchers.trial.local import build_launch_plan, execute, extensions_dir, free_port, log_tail
from launchers.trial.node_share import read_cpu_allowance
from launchers.trial.run import PACKAGE_ROOT, rank_plan
from optimizer.deepspeed.versions import installed_versions
from optimizer.perf.model_pass import depth_model, intercept_tokens, pass_terms
from optimizer.perf.probe_plan import ProbePlan, probe_plan
from optimizer.perf.skeleton import SKELETON_MICRO_STEPS, SKELETON_TOKENS, skeleton_bucket_elements, skeleton_model
from optimizer.study.errors import UserError
from optimizer.study.knobs import Candidate, FullCheckpointing, Precision, ZeroStage
from optimizer.study.machine_probe import PASS_INTERCEPT, PROBE_FORMAT, MachineProbe, ProbeFigure
from optimizer.study.specs import Accelerator, ModelInit, baseline_candidate
from optimizer.study.study_file import StudySpec
from optimizer.study.trial_settings import TrialSettings

PROBE_TIMEOUT_S = 180.0
"""Longest a probe's launch may run (s): its operations take seconds once the ops are built (the study builds them
first); a collective hung on one rank must not hold the study's start for long."""
SWITCH_VAR = "DSOPT_PROBE"
"""``off``: a study does not probe the machine (it still takes a cached probe); ``dsopt probe`` always does. The
suite sets it but for the tests of the probe, so that a probe is paid where it is tested."""
LOCK_NAME = "dsopt-probe.lock"
"""The node lock's file, in ``TORCH_EXTENSIONS_DIR`` (beside the ops' lock, :mod:`launchers.study.op_prep`)."""
CODE = ("launchers.rank.probe_rank", "launchers.rank.probe_pass", "launchers.rank.probe_engine",
        "optimizer.perf.probe_plan", "optimizer.perf.skeleton", "optimizer.perf.model_pass",
        "optimizer.study.machine_probe", "launchers.models.builtin", "launchers.models.hf_model",
        "launchers.models.four_bit", "launchers.models.trainable")
"""The modules whose source is in the cache key: an edit to what is timed or how (the model passes and the skeleton
are built by the trials' own model code) probes again."""


class ProbeUnavailable(RuntimeError):
    """The probe cannot run here (why in the message); the time model keeps the profile's figures."""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(plan: ProbePlan, *, gpus: Sequence[str] | None = None) -> str:
    """The machine a probe of ``plan`` runs on, in one line (host, CPU, cores, the GPUs this worker sees — ``gpus``,
    its slice of the node, else ``CUDA_VISIBLE_DEVICES`` — and the library versions)."""
    versions = ", ".join(f"{name} {version}" for name, version in installed_versions().items() if version)
    seen = ",".join(gpus) if gpus is not None else os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    devices = "CPU ranks" if plan.accelerator == "cpu" else f"GPUs {seen}"
    return f"{socket.gethostname()}, {cpu_model()}, {read_cpu_allowance()} cores, {devices}, {versions}"


def engine_plans(spec: StudySpec, plan: ProbePlan) -> list[dict[str, Any]]:
    """For each ZeRO stage of ``plan.engine_stages``, what a trial's ranks would be told for the study's skeleton
    (:func:`optimizer.perf.skeleton.skeleton_model`) at that stage in ``plan.engine_precision``: one sample of
    :data:`~optimizer.perf.skeleton.SKELETON_TOKENS` tokens per micro-step, two micro-steps per step, no offload or
    checkpointing (and the lowest stage again with every block checkpointed where the space recomputes blocks; then
    the stages below ZeRO-2 again in each other precision of the space, ``plan.engine_others`` at
    ``plan.engine_other_stages``), on one node's ranks — the
    DeepSpeed config built by dsopt's own builder for the skeleton, so its buckets are as many as the study's
    (:mod:`optimizer.perf.skeleton`). What trains (PEFT, frozen parameters) is the study's; a user's script
    (``trial.command``) is not run: the engine is DeepSpeed's whatever calls it."""
    skeleton = skeleton_model(spec.model)
    if not plan.engine_stages or isinstance(skeleton, str):
        return []
    hardware = replace(spec.hardware, nodes=1)
    training = replace(spec.training, sequence_length=SKELETON_TOKENS, micro_batch_size=1,
                       global_batch_size=SKELETON_MICRO_STEPS * hardware.world_size)
    small = replace(spec, model=skeleton, hardware=hardware, training=training,  # the study's seed; not its steps:
                    trial=TrialSettings(seed=spec.trial.seed))  # the rounds are the probe's (one cache key for them)
    base = replace(baseline_candidate(training), precision=Precision(plan.engine_precision))
    bucket = skeleton_bucket_elements(model=spec.model, skeleton=adapted_inventory(small).model)

    def engine(candidate: Candidate) -> dict[str, Any]:
        planned = rank_plan(study=small, candidate=candidate)
        zero = planned["config"].get("zero_optimization", {})
        for key in ("reduce_bucket_size", "allgather_bucket_size"):  # as many buckets as the study's, what trains
            if bucket is not None and key in zero:                   # being PEFT's (optimizer/perf/skeleton.py)
                zero[key] = bucket
        return {"stage": int(candidate.zero_stage), "precision": str(candidate.precision), **planned}

    engines = [engine(replace(base, zero_stage=ZeroStage(stage))) for stage in plan.engine_stages]
    if plan.engine_recompute:  # the lowest stage again, every block checkpointed: recomputation's own cost
        engines.append(engine(replace(base, zero_stage=ZeroStage(plan.engine_stages[0]),
                                      checkpointing=FullCheckpointing())))
    for other in plan.engine_others:  # DeepSpeed's path differs by precision (ProbePlan.engine_others)
        engines += [engine(replace(base, zero_stage=ZeroStage(stage), precision=Precision(other)))
                    for stage in plan.engine_other_stages]
    return engines


def pass_plans(spec: StudySpec, plan: ProbePlan) -> list[dict[str, Any]]:
    """For each precision of ``plan``, what a trial's ranks would be told for the study's model at ZeRO-0 in that
    precision, ``plan.pass_layers`` blocks deep (:func:`optimizer.perf.model_pass.depth_model`, its inventory traced
    again), and the passes to time on it (:mod:`optimizer.perf.model_pass`): each micro-batch of the space at the
    study's sequence length, and the intercept on one sample of a few tokens
    (:func:`optimizer.perf.model_pass.intercept_tokens`), timed first — each with its rows and the time model's count
    of its work (:func:`optimizer.perf.model_pass.pass_terms`). Empty where ``plan`` times no pass, or where what
    trains names a block the shorter model lacks (``frozen: [model.layers.10.*]``, PEFT's ``layers_to_transform``):
    the GEMM figures stand alone there."""
    if not plan.pass_layers:
        return []
    hardware = replace(spec.hardware, nodes=1)
    built = spec.training.model_init  # at ZeRO-0, where zero.Init (stage 3 only) builds on the device instead
    training = replace(spec.training, model_init=ModelInit.DEVICE if built is ModelInit.ZERO_INIT else built)
    try:  # the shorter model's own inventory (what trains in it, its biases and heads), as the study's is counted
        short = with_inventory(replace(spec, model=depth_model(spec.model, plan.pass_layers), hardware=hardware,
                                       training=training, trial=TrialSettings(seed=spec.trial.seed)),
                               warn=lambda line: None)
    except UserError:  # what trains names a block the two do not have (frozen: [model.layers.10.*]): no pass
        return []
    model, base = short.model, baseline_candidate(short.training)
    plans = []
    for precision in plan.precisions:
        candidate = replace(base, precision=Precision(precision))

        def one(micro_batch: int, tokens: int, variant: str = "", c: Candidate = candidate) -> dict[str, Any]:
            terms = pass_terms(candidate=c, model=model, hardware=hardware, training=short.training,
                               micro_batch=micro_batch, tokens=tokens)
            return {"micro_batch": 0 if variant else micro_batch, "variant": variant, "rows": model.rows(micro_batch),
                    "tokens": tokens, "terms": [list(term) for term in terms]}

        passes = [one(1, intercept_tokens(short.training.sequence_length), PASS_INTERCEPT)]  # first: kept if a
        passes += [one(b, short.training.sequence_length) for b in plan.micro_batches]  # wide one does not fit
        plans.append({"precision": precision, **rank_plan(study=short, candidate=candidate), "passes": passes})
    return plans


def rank_input(spec: StudySpec, plan: ProbePlan) -> dict[str, Any]:
    """What the probe's ranks read: ``plan``, the engines' plans (:func:`engine_plans`) and the model passes'
    (:func:`pass_plans`)."""
    return {**plan.to_json(), "engines": engine_plans(spec, plan), "passes": pass_plans(spec, plan)}


def cache_key(spec: StudySpec, plan: ProbePlan, *, gpus: Sequence[str] | None = None) -> str:
    """The cache key of a probe of ``spec`` by ``plan`` on this machine (module doc): the engines' plans are in
    it (what trains changes DeepSpeed's cost, not the plan's shapes)."""
    return json.dumps({"format": PROBE_FORMAT, "machine": machine_line(plan, gpus=gpus), "code": source_digest(CODE),
                       "plan": rank_input(spec, plan)}, sort_keys=True)


def store() -> KeyedJsonStore:
    return KeyedJsonStore(cache_dir() / "probe")


def merge(reports: list[dict[str, Any]], *, plan: ProbePlan, machine: str) -> MachineProbe:
    """One :class:`MachineProbe` from the ranks' reports (module doc)."""
    rounds: dict[tuple[str, str, int, str, float], list[list[float]]] = {}
    terms: dict[tuple[str, str, int, str, float], tuple[tuple[str, float], ...]] = {}
    skipped: dict[str, str] = {}
    for report in reports:
        for figure in report["figures"]:
            key = (figure["kind"], figure.get("precision", ""), int(figure.get("micro_batch", 0)),
                   figure.get("variant", ""), float(figure["work"]))
            rounds.setdefault(key, []).append([float(s) for s in figure["rounds_s"]])
            terms[key] = tuple((str(name), float(amount)) for name, amount in figure.get("terms", ()))
        for entry in report["skipped"]:
            skipped.setdefault(entry["what"], entry["why"])
    if plan.engine_skipped:
        skipped["DeepSpeed engine"] = plan.engine_skipped
    figures = []
    for (kind, precision, micro_batch, variant, work), per_rank in rounds.items():
        medians = [sorted(r)[len(r) // 2] for r in per_rank]
        every = [s for r in per_rank for s in r]
        low = max(min(every), 1e-12)
        figures.append(ProbeFigure(kind=kind, precision=precision, micro_batch=micro_batch, variant=variant,
                                   work=work, median_s=max(max(medians), low), low_s=low,
                                   high_s=max(max(every), max(medians)), repeats=min(len(r) for r in per_rank),
                                   terms=terms[(kind, precision, micro_batch, variant, work)]))
    return MachineProbe(machine=machine, measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
                        ranks=plan.ranks, seconds=max(float(r["seconds"]) for r in reports), figures=tuple(figures),
                        skipped=tuple(sorted(skipped.items())))


def announcement(plan: ProbePlan, *, within: str = "") -> str:
    """The line said as a probe of ``plan`` starts (``within``: the launch it rides, if not its own)."""
    return (f"probing this machine's kernels at the study's shapes on {plan.ranks} rank(s){within}: "
            f"{len(plan.precisions)} precision(s) x {len(plan.micro_batches)} micro-batch size(s), "
            f"{'collectives, ' if plan.reduce_bytes else ''}{'offload copies, ' if plan.copy_bytes else ''}"
            f"{'CPU Adam, ' if plan.host_adam_elements else ''}{'NVMe, ' if plan.nvme_path else ''}optimizer step"
            f"{', DeepSpeed engine at ZeRO ' + '/'.join(map(str, plan.engine_stages)) if plan.engine_stages else ''}")


def riding_input(spec: StudySpec, *, gpus: Sequence[str] | None = None) -> dict[str, Any] | None:
    """What the FP32 reference's launch probes once its steps are done (:func:`launchers.rank.probe_rank.after_trial`:
    no launch, imports or process group of the probe's own), or None where the study probes on a launch of its own
    or not at all: ``DSOPT_PROBE=off``, a probe of these shapes cached already, a reference that runs the user's
    script (``trial.command``: dsopt's rank program is not in that launch), one that spans nodes (a probe times one
    node), or CUDA ranks on a machine without CUDA."""
    if os.environ.get(SWITCH_VAR, "").lower() == "off" or spec.trial.command is not None or spec.hardware.nodes > 1:
        return None
    plan = probe_plan(spec)
    if plan.accelerator != Accelerator.CPU.value:
        import torch

        if not torch.cuda.is_available():
            return None
    return None if cached_probe(spec, gpus=gpus) is not None else rank_input(spec, plan)


def collect_riding(spec: StudySpec, folder: Path, *, gpus: Sequence[str] | None = None,
                   say: Callable[[str], None] | None = None) -> MachineProbe | None:
    """The probe the FP32 reference's launch took (``probe_rank<k>.json`` in its folder ``folder``), merged and
    cached as :func:`machine_probe` caches its own; None where a rank's report is missing or says the probe failed
    (:func:`with_probe` then probes on a launch of its own). ``say`` is told why: a rank's failure where one
    reported it, else the ranks that left no report (a rank whose probe fails exits at once and torchrun ends its
    peers, so only the first to fail may have written one)."""
    plan = probe_plan(spec)
    reports, missing = [], []
    for rank in range(plan.ranks):
        try:
            report = json.loads((folder / f"probe_rank{rank}.json").read_text())
        except (OSError, ValueError):
            missing.append(rank)
            continue
        if not isinstance(report, dict) or "figures" not in report:
            if say is not None and isinstance(report, dict) and "error" in report:
                say(f"the probe within the FP32 reference's launch failed on rank {rank}: {report['error']}")
            return None
        reports.append(report)
    if missing:
        if say is not None:
            say(f"the probe within the FP32 reference's launch left no report on rank(s) "
                f"{', '.join(map(str, missing))} (it did not finish there)")
        return None
    probe = merge(reports, plan=plan, machine=machine_line(plan, gpus=gpus))
    store().put(cache_key(spec, plan, gpus=gpus), probe.to_json())
    if say is not None:
        say(f"probe done within the FP32 reference's launch ({probe.seconds:.1f} s of timing, "
            f"{len(probe.figures)} figures)")
    return probe


def run_probe(spec: StudySpec, *, gpus: Sequence[str] | None = None,
              say: Callable[[str], None] | None = None) -> MachineProbe:
    """Time ``spec``'s operations on this node's ranks now (module doc), on ``gpus`` (this worker's slice of the
    node; None: the GPUs the process sees); ProbeUnavailable when it cannot."""
    plan = probe_plan(spec)
    cpu = plan.accelerator == Accelerator.CPU.value
    if not cpu:
        import torch

        if not torch.cuda.is_available():
            raise ProbeUnavailable("the study trains on CUDA GPUs and this machine has none")
    say = say or (lambda text: None)
    say(announcement(plan))
    machine = machine_line(plan, gpus=gpus)
    with tempfile.TemporaryDirectory(prefix="dsopt-probe-") as folder:
        out = Path(folder)
        plan_path = out / "plan.json"
        plan_path.write_text(json.dumps(rank_input(spec, plan)))
        launch = build_launch_plan(
            python=sys.executable, ranks=plan.ranks, cpu_ranks=cpu, master_port=free_port(), plan_path=plan_path,
            out_dir=out, base_env=os.environ, pythonpath=[str(PACKAGE_ROOT)], cwd=PACKAGE_ROOT,
            cpu_count=read_cpu_allowance(), launch_id=uuid.uuid4().hex, extensions_dir=extensions_dir(),
            parent_pid=os.getpid(), gpus=None if cpu else gpus, rank_module="launchers.rank.probe_rank")
        log = out / "probe.log"
        ended = execute(launch, timeout_s=PROBE_TIMEOUT_S, log_path=log)
        reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
        if ended.timed_out or len(reports) != plan.ranks:  # every rank's report: its timings stand, even if a
            # rank then died in teardown (a C++ terminate in a comm library's exit is no slower kernel)
            how = f"timed out after {PROBE_TIMEOUT_S:.0f} s" if ended.timed_out else f"exit {ended.returncode}"
            raise ProbeUnavailable(f"the probe's ranks failed ({how}): {log_tail(log, limit=4000)}")
    probe = merge(reports, plan=plan, machine=machine)
    say(f"probe done in {ended.wall_s:.1f} s ({probe.seconds:.1f} s of timing, {len(probe.figures)} figures)")
    return probe


def cached_probe(spec: StudySpec, *, gpus: Sequence[str] | None = None) -> MachineProbe | None:
    """The cached probe of ``spec``'s shapes on this machine, or None."""
    entry = store().get(cache_key(spec, probe_plan(spec), gpus=gpus))
    try:
        return None if entry is None else MachineProbe.from_json(entry)
    except ValueError:
        return None


def machine_probe(spec: StudySpec, *, refresh: bool = False, gpus: Sequence[str] | None = None,
                  holder: str = "dsopt", say: Callable[[str], None] | None = None) -> MachineProbe:
    """The probe of ``spec``'s shapes on this machine: cached, or run now and cached (``refresh``: run now). The run
    holds a node lock (``<TORCH_EXTENSIONS_DIR>/dsopt-probe.lock``, ``holder`` named in it): the workers of one
    node starting together probe once — the others wait, then read the cache — and never time each other."""
    if not refresh and (found := cached_probe(spec, gpus=gpus)) is not None:
        return found
    with node_lock(extensions_dir() / LOCK_NAME, holder=holder, say=say or (lambda text: None),
                   doing="probing the machine"):
        if not refresh and (found := cached_probe(spec, gpus=gpus)) is not None:
            return found
        probe = run_probe(spec, gpus=gpus, say=say)
        store().put(cache_key(spec, probe_plan(spec), gpus=gpus), probe.to_json())
    return probe


def with_probe(spec: StudySpec, *, gpus: Sequence[str] | None = None, holder: str = "dsopt",
               say: Callable[[str], None] | None = None) -> StudySpec:
    """``spec`` with this machine's probe attached (module doc); unchanged, with a line said, where it cannot run —
    or where ``DSOPT_PROBE=off`` (:data:`SWITCH_VAR`) says not to (a cached probe is still taken)."""
    if os.environ.get(SWITCH_VAR, "").lower() == "off":
        if (found := cached_probe(spec, gpus=gpus)) is not None:
            return replace(spec, hardware=replace(spec.hardware, probe=found))
        if say is not None:
            say(f"no probe of this machine ({SWITCH_VAR}=off); the time model uses the profile's figures and the "
                "trials'")
        return spec
    try:
        probe = machine_probe(spec, gpus=gpus, holder=holder, say=say)
    except ProbeUnavailable as err:
        if say is not None:
            say(f"no probe of this machine ({err}); the time model uses the profile's figures and the trials'")
        return spec
    return replace(spec, hardware=replace(spec.hardware, probe=probe))


def with_cached_probe(spec: StudySpec) -> StudySpec:
    """``spec`` with this machine's cached probe of its shapes attached, if there is one (nothing is run)."""
    probe = cached_probe(spec)
    return spec if probe is None else replace(spec, hardware=replace(spec.hardware, probe=probe))
