"""How well the machine's probe alone ranks a recorded grid's candidates by speed, and what limits it.

    python benchmarks/probe_rank_order.py benchmarks/data/grid-cpu.json [...] [--probe-from-here]

For each grid, Spearman's ρ between predicted and measured tokens/s over its ok candidates, for six time models:

* **probe alone** — the grid's recorded probe (``dsopt probe``; ``--probe-from-here``: this machine's, cached or
  measured now, for grids recorded before it) as the study reads it before any trial: kernels, collectives and
  DeepSpeed's engine per ZeRO stage on the model's skeleton (:mod:`optimizer.perf.skeleton`); ``-`` for a probe
  taken before the engine was timed;
* **probe, engine left out** — the same with DeepSpeed's per-micro-step cost taken as 0: what the kernels alone say;
* **probe + stage overhead (oracle)** — the same with each ZeRO stage's per-micro-step cost set to the median
  residual of that stage's rows: the best the probe could do with that one term known exactly;
* **k trials, no probe / with probe** — the time model calibrated (:func:`optimizer.perf.calibration.fit_rates`)
  on k random rows (median ρ over 10 draws), from the profile alone and from the probe;
* **every row** — calibrated on the whole grid: the ceiling of the linear time model on this grid (measurement
  noise and what the model's form cannot express).

Prints one table row per grid; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.rank_correlation import spearman  # noqa: E402
from launchers.probe.machine import with_probe  # noqa: E402
from launchers.trace.inventory import adapted_inventory  # noqa: E402
from optimizer.perf.calibration import TimeSample, fit_rates  # noqa: E402
from optimizer.perf.rates import FEATURES, Rates, Work  # noqa: E402
from optimizer.perf.throughput import StepTime, predict, profile_rates, work  # noqa: E402
from optimizer.search.ordering import candidate_of  # noqa: E402
from optimizer.study.machine_probe import MachineProbe  # noqa: E402
from optimizer.study.specs import baseline_candidate  # noqa: E402
from optimizer.study.study_file import load_study  # noqa: E402

DRAWS = 10
"""Random draws of k calibration rows."""


def rho(rates: Rates, jobs: list[Work], measured: list[float], ranks: int) -> float | None:
    pairs = [(p.tokens_per_s, m) for p, m in zip((predict(job=j, rates=rates, ranks=ranks) for j in jobs), measured,
                                                  strict=True) if isinstance(p, StepTime)]
    return spearman([p for p, _ in pairs], [m for _, m in pairs]) if len(pairs) >= 3 else None


def row(path: Path, *, here: bool) -> str:
    data = json.loads(path.read_text())
    plain = adapted_inventory(load_study(ROOT / data["study_file"]))
    if here:
        probed = with_probe(plain)
    elif data.get("probe"):
        probed = replace(plain, hardware=replace(plain.hardware, probe=MachineProbe.from_json(data["probe"])))
    else:
        return f"| {path.stem} | (no probe recorded: --probe-from-here) |"
    rows = [e for e in data["candidates"] if e["outcome"] == "ok" and e.get("step_time_s")]
    base = baseline_candidate(plain.training)
    ranks = plain.hardware.world_size
    jobs = [work(candidate=candidate_of(e["knobs"], base), model=plain.model, hardware=plain.hardware,
                 training=plain.training) for e in rows]
    measured = [e["tokens_per_s"] for e in rows]
    steps = [e["step_time_s"] for e in rows]
    probe_rates = profile_rates(hardware=probed.hardware)
    engine = [FEATURES.index(f"micro_steps_z{stage}") for stage in range(4)]
    alone = replace(probe_rates, seconds_per=tuple(0.0 if v is None else v for v in probe_rates.seconds_per))
    zero = replace(alone, seconds_per=tuple(0.0 if k in engine else v for k, v in enumerate(alone.seconds_per)),
                   step_shares=(), engine_factors=())
    seconds = list(zero.seconds_per)
    for stage in range(4):
        residuals = [(t - predict(job=j, rates=zero, ranks=ranks).total_s) / j.micro_steps
                     for j, t in zip(jobs, steps, strict=True) if int(j.stage) == stage]
        if residuals:
            seconds[FEATURES.index(f"micro_steps_z{stage}")] = max(0.0, statistics.median(residuals))
    oracle = replace(zero, seconds_per=tuple(seconds))

    def calibrated(prior: Rates, k: int) -> str:
        values = []
        for seed in range(DRAWS):
            picked = random.Random(seed).sample(range(len(rows)), k)
            fitted = fit_rates([TimeSample(work=jobs[i], step_time_s=steps[i]) for i in picked], prior=prior)
            value = rho(fitted, jobs, measured, ranks)
            if value is not None:
                values.append(value)
        return f"{statistics.median(values):.2f}" if values else "-"

    plain_rates = profile_rates(hardware=plain.hardware)
    every = fit_rates([TimeSample(work=j, step_time_s=t) for j, t in zip(jobs, steps, strict=True)], prior=probe_rates)

    def text(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    few = " | ".join(f"{calibrated(plain_rates, k)} / {calibrated(probe_rates, k)}" for k in (4, 8))
    engine_timed = any(probe_rates.seconds_per[k] is not None for k in engine)
    return (f"| {path.stem} | {len(rows)} | {text(rho(alone, jobs, measured, ranks)) if engine_timed else '-'} | "
            f"{text(rho(zero, jobs, measured, ranks))} | "
            f"{text(rho(oracle, jobs, measured, ranks))} | {few} | {text(rho(every, jobs, measured, ranks))} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", nargs="+", help="recorded grid(s), benchmarks/data/*.json")
    parser.add_argument("--probe-from-here", action="store_true",
                        help="use this machine's probe (cached, or measured now), not the one recorded with the grid")
    args = parser.parse_args()
    print("| grid | ok rows | probe alone | probe, engine left out | probe + stage overhead (oracle) | "
          "4 trials: no probe / probe | 8 trials: no probe / probe | every row (ceiling) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.grid:
        print(row(Path(name), here=args.probe_from_here), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
