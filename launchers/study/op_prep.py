"""Ops before clocks: build or load the DeepSpeed ops a study's candidates need, once per node, before a worker's
first trial — outside every trial's timeout.

DeepSpeed JIT-builds an op the first time a rank loads it (:mod:`launchers.ops.op_needs` says which op each candidate
needs): a cold CPU build of ``cpu_adam`` takes a minute or two, FusedAdam on CUDA needs nvcc, NVMe offload needs
libaio. Left to the trials, the first trial of each kind spends its timeout compiling (a ``timeout``), and a node
that cannot build an op records every candidate that needs it as a ``crash``. Instead :func:`prepare_ops`, called
where a worker starts (``launchers.study.study_run.run_study``: ``dsopt study run`` and ``dsopt worker``, the SLURM
workers included), before the FP32 reference:

1. collects the ops the study needs: those of every valid candidate of its search space and of the FP32 reference;
2. builds or loads them in one subprocess (:mod:`launchers.ops.op_load`, DeepSpeed's own builders:
   ``create_op_builder``, ``is_compatible()``, ``load()``) started like a trial — the environment a trial's ranks
   get (:func:`launchers.trial.run.trial_launch_plan`: ``TORCH_EXTENSIONS_DIR``, ``DS_ACCELERATOR``, the worker's GPUs)
   and :func:`launchers.trial.local.execute` (stale JIT-build locks cleared first, the locks it holds recorded, nothing
   left behind at its timeout, :data:`OP_BUILD_TIMEOUT_S`) — holding a node lock (``flock`` on
   ``<TORCH_EXTENSIONS_DIR>/dsopt-ops.lock``) so that two workers of one node do not build at once: the second waits,
   then finds the ops cached and only loads them. The kernel releases an ``flock`` when its holder dies, so this
   lock cannot go stale (torch's own build lock can: :mod:`launchers.ops.build_locks`);
3. an op that cannot be built or loaded (no compiler, no libaio, a build past its timeout) is one message naming the
   op, why, and the candidates it rules out. Those are *invalid* on this node: dropped from the worker's search
   space (the launch policy never picks them), and a launch of one — the sampler's own proposal — is an ``invalid``
   result with that reason, never started (:func:`launchers.trial.run.run_trial`); never a ``crash``. If the op rules
   out every candidate, or the FP32 reference (not cached yet), the command stops with that message (UserError:
   exit code 2).

Its output: ``studies/<name>/ops/<host>-<pid>.log`` (the builders' output) and ``.json`` (per op: status, reason,
seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from launchers.ops.build_locks import node_lock
from launchers.ops.op_needs import Op, allowed_offloads, missing_reason, note_missing, ops_for, ops_needed
from launchers.trial.local import execute, extensions_dir
from launchers.trial.run import cached_reference_losses, reference_candidate, trial_launch_plan
from optimizer.search.space import branches, in_space
from optimizer.study.constraints import invalid_reasons
from optimizer.study.errors import UserError
from optimizer.study.knobs import Candidate
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import StudySpec

OP_BUILD_TIMEOUT_S = 1800.0
"""The ops' build, all together (s): a cold CUDA FusedAdam build takes minutes, a CPU ``cpu_adam`` one or two;
half an hour leaves room for a slow shared filesystem without waiting forever on a hung compiler."""
LOCK_NAME = "dsopt-ops.lock"
"""The node lock's file, in ``TORCH_EXTENSIONS_DIR`` (beside the ops, outside torch's ``<op>/lock`` globs)."""
EXAMPLES = 3
"""Candidates named in a message; the rest are counted."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OpResult:
    """What the build subprocess found of one op."""

    op: Op
    """The op."""
    status: str
    """``ready``, ``skipped`` (optional, and DeepSpeed does without it here) or ``missing``."""
    why: str
    """Why it is skipped or missing ('' when ready)."""
    load_s: float
    """Seconds its ``load()`` took: a build, or a check of the cache."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OpsPrepared:
    """One build of the study's ops on this node."""

    results: tuple[OpResult, ...]
    """Per op, in :data:`launchers.ops.op_needs.OPS` order."""
    wall_s: float
    """Seconds the build subprocess ran."""
    waited_s: float
    """Seconds spent waiting for another worker's build on this node first."""
    log_path: Path
    """The builders' output."""

    def missing(self) -> dict[str, str]:
        """Op name → why, for the ops that cannot be used here."""
        return {r.op.name: r.why for r in self.results if r.status == "missing"}


def study_candidates(spec: StudySpec) -> list[Candidate]:
    """The candidates a worker may launch: the valid ones of the search space (what ``branches`` keeps and the
    ledger's constraints accept)."""
    space = branches(spec)
    base = baseline_candidate(spec.training)
    return [c for c in spec.search_space.candidates(base) if in_space(c, space)
            and not invalid_reasons(candidate=c, model=spec.model, hardware=spec.hardware, training=spec.training)]


def build_ops(ops: Sequence[Op], *, spec: StudySpec, gpus: Sequence[str] | None, holder: str,
              say: Callable[[str], None], timeout_s: float = OP_BUILD_TIMEOUT_S) -> OpsPrepared:
    """Build or load ``ops`` in one subprocess with a trial's environment, under the node lock (module doc)."""
    folder = spec.output_dir / "ops"
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{socket.gethostname()}-{os.getpid()}"
    log_path, out = folder / f"{stem}.log", folder / f"{stem}.json"
    out.unlink(missing_ok=True)
    plan = trial_launch_plan(spec, plan_path=out, out_dir=folder, launch_id=uuid.uuid4().hex, gpus=gpus)
    names = [op.builder + (":optional" if op.optional else "") for op in ops]
    plan = dataclasses.replace(plan, argv=(sys.executable, "-m", "launchers.process.orphan_guard", str(os.getpid()),
                                           sys.executable, "-m", "launchers.ops.op_load", str(out), *names))
    with node_lock(extensions_dir() / LOCK_NAME, holder=holder, say=say, doing="building DeepSpeed ops") as waited_s:
        run = execute(plan, timeout_s=timeout_s, log_path=log_path)
    report: dict = {}
    with contextlib.suppress(OSError, ValueError):
        report = json.loads(out.read_text())
    results = []
    for op in ops:
        entry = report.get(op.builder)
        if entry is None:  # the subprocess never got to it
            why = (f"the build did not finish within {timeout_s:.0f} s" if run.timed_out
                   else f"the build process ended (exit status {run.returncode}) before reaching it")
            entry = {"status": "missing", "why": why, "load_s": 0.0}
        why = str(entry.get("why", ""))
        if entry["status"] == "missing":
            why = f"{why}; it needs {op.needs} (log: {log_path})"
        results.append(OpResult(op=op, status=str(entry["status"]), why=why, load_s=float(entry.get("load_s", 0.0))))
    return OpsPrepared(results=tuple(results), wall_s=run.wall_s, waited_s=waited_s, log_path=log_path)


def ready_text(prepared: OpsPrepared, *, host: str) -> str:
    """One line: what was built or loaded on ``host``, in how long, outside any trial's clock."""
    done = ", ".join(f"{r.op.name} {r.load_s:.1f} s" if r.status == "ready" else f"{r.op.name} {r.status}"
                     for r in prepared.results)
    waited = f" after waiting {prepared.waited_s:.0f} s for another worker's build" if prepared.waited_s >= 1 else ""
    return (f"DeepSpeed ops built or loaded on {host} in {prepared.wall_s:.1f} s{waited}, before the first trial and "
            f"outside any trial's clock: {done}; log: {prepared.log_path}")


def ruled_out_text(op: Op, why: str, *, ruled_out: Sequence[Candidate], of: int, host: str) -> str:
    """One message: the op, why it cannot be used on ``host``, and the candidates it rules out (of ``of``)."""
    named = ", ".join(c.label() for c in ruled_out[:EXAMPLES])
    more = f" and {len(ruled_out) - EXAMPLES} more" if len(ruled_out) > EXAMPLES else ""
    return (f"DeepSpeed op {op.name} ({op.used_by}) cannot be used on {host}: {why}. It rules out "
            f"{len(ruled_out)} of {of} candidate(s) ({named}{more}): recorded as invalid on this node, never "
            "launched")


def narrowed(spec: StudySpec, missing: Mapping[str, str]) -> StudySpec:
    """``spec`` with the offload devices whose candidates all need a missing op dropped from its search space
    (:func:`launchers.ops.op_needs.allowed_offloads`)."""
    if not missing:
        return spec
    base = baseline_candidate(spec.training)
    values = dict(spec.search_space.values)
    optimizer, param = allowed_offloads(
        accelerator=spec.hardware.accelerator, missing=missing, base=base,
        optimizer=values.get("offload_optimizer", (base.offload_optimizer,)),
        param=values.get("offload_param", (base.offload_param,)))
    kept = {"offload_optimizer": optimizer, "offload_param": param}
    space = dataclasses.replace(spec.search_space, values=tuple((name, kept.get(name, options))
                                                                for name, options in spec.search_space.values))
    return dataclasses.replace(spec, search_space=space)


def prepare_ops(*, spec: StudySpec, gpus: Sequence[str] | None, worker: str,
                say: Callable[[str], None] | None = None,
                candidates: Sequence[Candidate] | None = None) -> StudySpec:
    """Build or load the ops ``spec``'s candidates need on this node (module doc); returns ``spec`` without the
    candidates an op missing here rules out. UserError (exit 2) when that leaves no candidate, or rules out the
    FP32 reference before it is cached. ``candidates``: :func:`study_candidates` where the caller has them."""
    say = say or (lambda text: print(f"[{worker}] {text}", file=sys.stderr, flush=True))
    accelerator = spec.hardware.accelerator
    candidates = study_candidates(spec) if candidates is None else list(candidates)
    reference = reference_candidate(spec)
    ops = ops_needed([*candidates, reference], accelerator=accelerator)
    if not ops:
        return spec
    host = socket.gethostname()
    say(f"building or loading DeepSpeed ops {', '.join(op.name for op in ops)} on {host} before the first trial")
    prepared = build_ops(ops, spec=spec, gpus=gpus, holder=worker, say=say)
    missing = prepared.missing()
    note_missing(accelerator, missing)
    say(ready_text(prepared, host=host))
    for result in prepared.results:
        if result.status == "missing":
            hit = [c for c in candidates if result.op in ops_for(c, accelerator=accelerator)]
            say(ruled_out_text(result.op, result.why, ruled_out=hit, of=len(candidates), host=host))
    if not missing:
        return spec
    left = [c for c in candidates if missing_reason(c, accelerator=accelerator, missing=missing) is None]
    if candidates and not left:
        whys = "; ".join(f"{name}: {why}" for name, why in missing.items())
        raise UserError(source=str(spec.path), key="search_space", why=f"every one of the {len(candidates)} "
                        f"candidate(s) needs a DeepSpeed op that cannot be built or loaded on {host} — {whys}")
    why = missing_reason(reference, accelerator=accelerator, missing=missing)
    if why is not None and cached_reference_losses(spec) is None:
        raise UserError(source=str(spec.path), key="hardware", why=f"the FP32 reference ({reference.label()}) "
                        f"cannot run on {host}: {why}")
    return narrowed(spec, missing)
