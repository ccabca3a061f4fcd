"""Which of DeepSpeed's JIT-built ops a candidate needs, and what a missing one rules out (pure, but for the one
record of what this process found missing: :func:`note_missing`).

Read from DeepSpeed 0.19.8's sources; the ops are those ``deepspeed.ops.op_builder`` names (``NAME``, the folder
under ``TORCH_EXTENSIONS_DIR``), created by the accelerator the ranks run on
(``get_accelerator().create_op_builder(builder)``; CPU ranks get ``deepspeed/ops/op_builder/cpu/``'s builders):

* the optimizer — the config's ``"type": "Adam"``/``"AdamW"`` goes to ``engine.get_optimizer_configuration``
  (``runtime/engine.py:2384-2409``): with ``offload_optimizer`` on ``cpu`` or ``nvme``
  (``zero_use_cpu_optimizer``, engine.py:1562) it is DeepSpeedCPUAdam, op ``cpu_adam`` (``ops/adam/cpu_adam.py:93``);
  otherwise FusedAdam, op ``fused_adam`` (``ops/adam/fused_adam.py:94``) — built with nvcc on CUDA, and on CPU
  ranks built too, from the CPU accelerator's own ``FusedAdamBuilder`` (``op_builder/cpu/fused_adam.py``): plain
  Adam without offload needs a C++ compiler there as well;
* NVMe offload, of the optimizer or of the parameters: op ``async_io`` (``runtime/swap_tensor/``), which needs
  libaio (its ``is_compatible`` links a test program against ``-laio``) and loads ``pin_memory`` first;
* CPU ranks, every candidate: ``deepspeed_shm_comm``, DeepSpeed's shared-memory collectives, built when the
  communication backend starts (``comm/torch.py:48`` ``build_shm_op``) — only where DeepSpeed deems it compatible
  (Linux); where it is not, DeepSpeed uses gloo alone, so it is *optional*. CUDA ranks never build it (NCCL).

The ops depend only on the accelerator and the two offload knobs, so what a missing op rules out is a set of
offload devices (:func:`allowed_offloads`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from optimizer.study.knobs import Candidate, OffloadDevice
from optimizer.study.specs import Accelerator


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """One DeepSpeed op a trial may build at first use."""

    builder: str
    """The builder's class name, as ``get_accelerator().create_op_builder`` takes it."""
    name: str
    """The op's ``NAME``: its folder under ``TORCH_EXTENSIONS_DIR``."""
    used_by: str
    """What in DeepSpeed loads it."""
    needs: str
    """What building it needs, for the message when it cannot be built."""
    optional: bool = False
    """DeepSpeed does without it where its ``is_compatible()`` says no (it never tries to load it there)."""


SHM_COMM = Op(builder="ShareMemCommBuilder", name="deepspeed_shm_comm", optional=True,
              used_by="DeepSpeed's shared-memory collectives on CPU ranks", needs="a C++ compiler and ninja")
FUSED_ADAM = Op(builder="FusedAdamBuilder", name="fused_adam", used_by="FusedAdam (Adam without optimizer offload)",
                needs="a C++ compiler and ninja (on CUDA: nvcc, the CUDA toolkit matching torch)")
CPU_ADAM = Op(builder="CPUAdamBuilder", name="cpu_adam", used_by="DeepSpeedCPUAdam (optimizer offload to cpu or nvme)",
              needs="a C++ compiler and ninja")
ASYNC_IO = Op(builder="AsyncIOBuilder", name="async_io", used_by="ZeRO-Infinity's NVMe swapping",
              needs="libaio (headers and library: libaio-dev with apt, libaio-devel with yum, or CFLAGS/LDFLAGS "
                    "pointing to it) and a C++ compiler")
OPS = (SHM_COMM, FUSED_ADAM, CPU_ADAM, ASYNC_IO)


def ops_for(candidate: Candidate, *, accelerator: Accelerator) -> tuple[Op, ...]:
    """The ops ``candidate``'s ranks build or load at first use on ``accelerator`` (module doc)."""
    ops = [SHM_COMM] if accelerator is Accelerator.CPU else []
    ops.append(FUSED_ADAM if candidate.offload_optimizer is OffloadDevice.NONE else CPU_ADAM)
    if OffloadDevice.NVME in (candidate.offload_optimizer, candidate.offload_param):
        ops.append(ASYNC_IO)
    return tuple(ops)


def ops_needed(candidates: Iterable[Candidate], *, accelerator: Accelerator) -> tuple[Op, ...]:
    """Every op any of ``candidates`` needs, in :data:`OPS` order."""
    needed = {op for candidate in candidates for op in ops_for(candidate, accelerator=accelerator)}
    return tuple(op for op in OPS if op in needed)


def missing_reason(candidate: Candidate, *, accelerator: Accelerator, missing: Mapping[str, str]) -> str | None:
    """Why ``candidate`` cannot run here — ``missing`` maps an op's name to why it cannot be built or loaded — or
    None when every op it needs is there."""
    reasons = [f"DeepSpeed op {op.name} ({op.used_by}) is not available on this node: {missing[op.name]}"
               for op in ops_for(candidate, accelerator=accelerator) if op.name in missing]
    return "; ".join(reasons) or None


def allowed_offloads(*, accelerator: Accelerator, missing: Mapping[str, str],
                     optimizer: Iterable[OffloadDevice], param: Iterable[OffloadDevice],
                     base: Candidate) -> tuple[tuple[OffloadDevice, ...], tuple[OffloadDevice, ...]]:
    """Of the ``optimizer`` and ``param`` offload devices, those some candidate can still use with ``missing``'s
    ops gone (a device is kept if it runs with one of the other knob's devices). The ops depend on each knob alone
    (module doc), so the kept pairs are exactly the product of the two results."""
    optimizer, param = tuple(optimizer), tuple(param)

    def runs(opt: OffloadDevice, par: OffloadDevice) -> bool:
        pair = replace(base, offload_optimizer=opt, offload_param=par)
        return missing_reason(pair, accelerator=accelerator, missing=missing) is None

    return (tuple(o for o in optimizer if any(runs(o, p) for p in param)),
            tuple(p for p in param if any(runs(o, p) for o in optimizer)))


_MISSING_HERE: dict[Accelerator, dict[str, str]] = {}
"""What this process's op preparation (:func:`launchers.study.op_prep.prepare_ops`) found missing, per accelerator:
op name → why. A launch of a candidate that needs one of them is an ``invalid`` result, never started
(:func:`launchers.trial.run.run_trial`)."""


def note_missing(accelerator: Accelerator, missing: Mapping[str, str]) -> None:
    """Record what this process found missing on ``accelerator`` (replaces an earlier record)."""
    _MISSING_HERE[accelerator] = dict(missing)


def missing_here(accelerator: Accelerator) -> Mapping[str, str]:
    """What :func:`note_missing` recorded for ``accelerator`` (nothing when no preparation ran: a single
    ``dsopt trial`` builds its ops at first use, as DeepSpeed does)."""
    return _MISSING_HERE.get(accelerator, {})
