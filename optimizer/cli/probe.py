"""``dsopt probe STUDY``: this machine's kernels timed at the study's shapes, beside the profile's datasheet."""

from __future__ import annotations

import argparse
import json
import sys

from optimizer.cli.common import counted, runnable_model, runnable_study
from optimizer.study.errors import UserError
from optimizer.study.machine_probe import MachineProbe, ProbeFigure
from optimizer.study.specs import Precision
from optimizer.study.study_file import StudySpec, load_study

UNITS = {"gemm": ("TFLOP/s", 1e12), "attention": ("TFLOP/s", 1e12), "device_adam": ("Mparams/s", 1e6),
         "host_adam": ("Mparams/s", 1e6), "engine_micro": ("micro-steps/s", 1.0), "engine_step": ("micro-steps/s", 1.0),
         "pass": ("TFLOP/s", 1e12)}
"""How a figure's rate prints (the rest: GB/s, 10^9 bytes per second); a model pass in the FLOPs the time model counts
for it."""


def datasheet(study: StudySpec, figure: ProbeFigure) -> str:
    """The profile's figure for what ``figure`` timed ('-' where the profile has none)."""
    profile = study.hardware.profile
    if profile is None:
        return "-"
    value = None
    if figure.kind in ("gemm", "attention"):
        peak = profile.flops(Precision(figure.precision))
        value = peak and peak / 1e12
    elif figure.kind == "host_adam":
        value = profile.host_adam_params_per_s and profile.host_adam_params_per_s / 1e6
    elif figure.kind == "copy":
        value = profile.pcie_bytes_per_s and profile.pcie_bytes_per_s / 1e9
    elif figure.kind == "memory":
        value = profile.memory_bytes_per_s and profile.memory_bytes_per_s / 1e9
    elif figure.kind in ("all_reduce", "reduce_scatter", "all_gather"):
        value = profile.link_bytes_per_s and profile.link_bytes_per_s / 1e9
    return "-" if not value else f"{value:,.4g}"


def table(study: StudySpec, probe: MachineProbe) -> list[str]:
    lines = [f"probe of {probe.machine}", f"measured {probe.measured_at} on {probe.ranks} rank(s) at once, "
             f"{probe.seconds:.1f} s of timing; each figure: the slowest rank's median of its rounds, and the "
             "fastest / slowest round of any rank", "",
             "| what | work per run | median ms | rate (slowest rank) | datasheet | spread (high-low)/median |",
             "|---|---|---|---|---|---|"]
    for f in probe.figures:
        unit, scale = UNITS.get(f.kind, ("GB/s", 1e9))
        work = f"{f.work / 1e9:,.3f} GFLOP" if unit == "TFLOP/s" else (
            f"{f.work:,.0f} params" if unit == "Mparams/s" else "1 micro-step of the skeleton"
            if f.kind.startswith("engine") else f"{f.work / 1e6:,.3f} MB")
        lines.append(f"| {f.label()} | {work} | {f.median_s * 1e3:,.3f} | {f.work / f.median_s / scale:,.4g} {unit} "
                     f"| {datasheet(study, f)} | {f.spread:.0%} |")
    if probe.skipped:
        lines += ["", "not timed here:"] + [f"  {what}: {why}" for what, why in probe.skipped]
    return lines


def run(args: argparse.Namespace) -> int:
    from launchers.probe.machine import ProbeUnavailable, cached_probe, machine_probe
    from launchers.study.op_prep import prepare_ops

    runnable_model(load_study(args.study), what="probe")
    study, gpus = runnable_study(args.study)

    def say(text: str) -> None:
        print(f"[probe] {text}", file=sys.stderr, flush=True)

    study = counted(study)
    cached = None if args.refresh else cached_probe(study)
    if cached is None:  # DeepSpeedCPUAdam is timed as the trials load it: built first
        study = prepare_ops(spec=study, gpus=gpus, worker="probe", say=say)
    else:
        say(f"this machine's probe of these shapes from {cached.measured_at} (cached); --refresh measures again")
    try:
        probe = machine_probe(study, refresh=args.refresh, say=say)
    except ProbeUnavailable as err:
        raise UserError(source=str(study.path), key="hardware", why=f"cannot probe this machine: {err}") from err
    if args.json:
        print(json.dumps({"study": study.name, "probe": probe.to_json()}, indent=2))
    else:
        print("\n".join(table(study, probe)))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    probe = sub.add_parser("probe", help="time this machine's kernels at the study's shapes (cached per machine)")
    probe.add_argument("study", help="study file with a transformer-mode model")
    probe.add_argument("--json", action="store_true", help="print JSON (seconds, bytes, FLOPs)")
    probe.add_argument("--refresh", action="store_true", help="measure again even if this machine's probe is cached")
    probe.set_defaults(run=run)
