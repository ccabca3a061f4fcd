"""Search efficiency: replay search strategies against a recorded grid of real measurements.

    python benchmarks/search_efficiency.py [--grid GRID.json ...] [--seeds 20] [--without-probe]

Default: the recorded grids benchmarks/data/grid-cpu.json, grid-llama-cpu.json and grid-qwen2-cpu.json. The grid
(benchmarks/record_grid.py) holds one real DeepSpeed measurement per valid candidate, and the probe of its machine
where it was recorded with one (the replay's time model uses it unless ``--without-probe``). A strategy "launches"
a candidate by looking its measurement up; what counts is how many launches it needs before it has launched a
feasible candidate within 2 % of the grid's best feasible throughput.

Ground truth, per candidate: the device share of the measured peak (measured − the ledger's host items,
see record_grid.py) above the per-rank budget is an **OOM launch** (on a GPU it would have run out of
memory); **feasible** = ran ok, no OOM, loss fidelity within the precision's tolerance.

Strategies:
* **dsopt** — the study as built (launchers/study/study_run.run_study): ledger pruning with the calibrated memory
  factor, the launch policy (optimizer/search/launch_policy.py: the probability to fit; next_launch.py: the
  value of a launch), the enqueued seeds, every 3rd proposal left to TPE; the launches are replaced by
  look-ups (its ``runner``, which returns the recorded measurement: the study itself judges it against the
  budget), everything else is the real code, on a SQLite storage. Its progress lines are not printed.
* **autotuner** — DeepSpeed's Autotuner walk (benchmarks/autotuner_walk.py): ZeRO stages in order and the
  micro-batch by its memory model; neither offload nor precision nor checkpointing. One run.
* **tpe** — Optuna's TPE over the same conditional space with no ledger: every sample is launched.
* **random** — the valid candidates in a random order.

A strategy that samples a candidate it already launched reuses the result (no launch). Reported per strategy
over the seeds: launches to ≥ 98 % of the best (median, worst; "never" counts as all its launches), OOM
launches, and for dsopt the false prunes (pruned, never launched, measured to fit), the risky candidates held
on a sampler's proposal and never launched that measured to fit, and the time model's Spearman ρ with the
measured throughput of every ok candidate (calibrated on a run's trials, median over runs); and, per grid, the
time model's ρ before any trial; and in how many runs the first launch was feasible and within 10 % of the best's
speed (:data:`FIRST_WITHIN`), and in how many the best feasible speed known after it — the FP32 reference's
included — was.

dsopt's FP32 reference run: a real study launches it first (for the losses every trial is judged against) and,
where its candidate is in the space, records it as that candidate's trial before its first launch, and chooses its
seeds knowing it (docs/studies.md, "The launch policy"). The replay records the grid's measurement of that
candidate the same way (``--without-reference``: as the replays did before 2026-12-07, as if it measured nothing).
Its launch is the study's fixed first one and is not counted among the launches; where it is itself the target,
the target is reached after 0 launches (the first launch is still made and reported). Asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import optuna

from launchers.study.study_run import run_study
from launchers.trace.inventory import adapted_inventory
from launchers.trace.study_traces import with_traced_activations
from launchers.trial.run import reference_candidate
from optimizer.ledger.core import evaluate
from optimizer.perf.throughput import StepTime, predict, profile_rates, work
from optimizer.results.trial_result import Outcome, RankMeasurement, TrialResult
from optimizer.search.ordering import candidate_of, study_models
from optimizer.search.space import branches, sample_candidate
from optimizer.study.knobs import Candidate, Precision
from optimizer.study.machine_probe import MachineProbe
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import StudySpec, load_study
from optimizer.study.units import parse_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ beside the packages
from benchmarks.autotuner_walk import autotuner_walk
from benchmarks.rank_correlation import spearman

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.98
FIRST_WITHIN = 0.9  # a first launch counts when feasible and at least this share of the best's speed (issue 38)
GRIDS = (ROOT / "benchmarks" / "data" / "grid-cpu.json", ROOT / "benchmarks" / "data" / "grid-llama-cpu.json",
         ROOT / "benchmarks" / "data" / "grid-qwen2-cpu.json")
"""The recorded grids: the built-in tiny GPT, a 4-layer GQA Llama and a 3-layer GQA Qwen2 with tied embeddings
(``record_grid.py``)."""


STRATEGIES = {"dsopt": "dsopt", "autotuner walk": "autotuner", "TPE, no ledger": "tpe", "random": "random"}
"""The strategies' table names and their ``--strategy`` names."""


class StopReplay(Exception):
    """The strategy reached the target: stop it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Grid:
    """The recorded grid and its ground truth."""

    spec: StudySpec
    entries: dict[str, dict]
    best_tokens_per_s: float

    def oom(self, entry: dict) -> bool:
        device = (entry["measured_peak_bytes"] or 0) - entry["predicted_host_bytes"]
        return entry["outcome"] == "oom" or (entry["outcome"] == "ok" and device > self.spec.hardware.gpu_memory_bytes)

    def feasible(self, entry: dict) -> bool:
        if entry["outcome"] != "ok" or self.oom(entry) or entry["loss_fidelity"] is None:
            return False
        return entry["loss_fidelity"] <= self.spec.trial.tolerance(Precision(entry["knobs"]["precision"]))

    def hit(self, entry: dict) -> bool:
        return self.feasible(entry) and entry["tokens_per_s"] >= TARGET * self.best_tokens_per_s


class NothingFeasible(ValueError):
    """No candidate of the grid fits the budget: there is no best to find."""


def load_grid(path: Path, *, budget_bytes: int | None = None, probe: bool = True) -> Grid:
    """The grid and its ground truth, at the study's per-rank budget or at ``budget_bytes`` (the measurements
    do not depend on the budget: only what counts as an OOM and which candidates fit), with the probe recorded
    with it unless ``probe`` is False (grids recorded before the probe have none)."""
    data = json.loads(path.read_text())
    # as the study itself traces it (and, where it trains in part, counts it)
    spec = with_traced_activations(adapted_inventory(load_study(ROOT / data["study_file"])))
    if data.get("probe") and probe:  # the kernels of the machine the grid was recorded on (record_grid.py)
        spec = replace(spec, hardware=replace(spec.hardware, probe=MachineProbe.from_json(data["probe"])))
    if budget_bytes is not None:
        spec = replace(spec, hardware=replace(spec.hardware, gpu_memory_bytes=budget_bytes))
    entries = {e["label"]: e for e in data["candidates"]}
    grid = Grid(spec=spec, entries=entries, best_tokens_per_s=0.0)
    feasible = [e["tokens_per_s"] for e in entries.values() if grid.feasible(e)]
    if not feasible:
        peaks = [e["measured_peak_bytes"] for e in entries.values() if e.get("measured_peak_bytes")]
        raise NothingFeasible(f"{path}: no candidate fits {spec.hardware.gpu_memory_bytes / 1e6:g} MB per rank "
                              f"(the smallest measured peak is {min(peaks, default=0) / 1e6:g} MB): nothing to "
                              "search for")
    return Grid(spec=spec, entries=entries, best_tokens_per_s=max(feasible))


@dataclass
class Run:
    """One strategy run: the launches in order."""

    launched: list[str]
    reached_at: int | None = None
    false_prunes: int = 0
    held_fits: int = 0
    spearman: float | None = None

    def launch(self, grid: Grid, label: str) -> dict:
        entry = grid.entries[label]
        self.launched.append(label)
        if self.reached_at is None and grid.hit(entry):
            self.reached_at = len(self.launched)
        return entry

    def ooms(self, grid: Grid) -> int:
        return sum(1 for label in self.launched if grid.oom(grid.entries[label]))


def as_result(grid: Grid, entry: dict) -> TrialResult:
    """A recorded measurement as the TrialResult a launch returned: the run's own outcome and measurements —
    whether a measured peak is over the budget is for the study to judge (optimizer.search.objective.over_budget), as it
    does for a real launch on CPU ranks."""
    if entry["outcome"] != "ok":
        return TrialResult(outcome=Outcome(entry["outcome"]), message="replay")
    rank = RankMeasurement(rank=0, peak_allocated_bytes=entry["measured_peak_bytes"], peak_reserved_bytes=None,
                           peak_rss_bytes=0, step_times_s=(entry["step_time_s"],),
                           training_peak_allocated_bytes=entry.get("training_peak_bytes"),
                           init_peak_allocated_bytes=entry.get("init_peak_bytes"))
    return TrialResult(outcome=Outcome.OK, ranks=(rank,), step_time_s=entry["step_time_s"],
                       tokens_per_s=entry["tokens_per_s"], loss_fidelity=entry["loss_fidelity"])


def reference_entry(grid: Grid) -> dict | None:
    """The grid's measurement of the study's FP32 reference candidate (:func:`launchers.trial.run.reference_candidate`),
    or None where the grid did not record it."""
    return grid.entries.get(reference_candidate(grid.spec).label())


def run_dsopt(grid: Grid, seed: int, folder: Path, *, with_reference: bool = True) -> Run:
    """The study as built, its launches looked up. ``with_reference``: the FP32 reference run is a whole trial of
    its candidate, recorded before the first launch as a real study records it (its launch is the study's fixed
    first one, for the losses: not counted here; where it is itself the target, the target is reached after 0)."""
    run = Run(launched=[])

    def runner(candidate: Candidate, _reference: list[float]) -> TrialResult:
        entry = run.launch(grid, candidate.label())
        result = as_result(grid, entry)
        if run.reached_at is not None:
            raise StopReplay
        return result

    reference = reference_entry(grid) if with_reference else None
    if reference is not None and grid.hit(reference):
        run.reached_at = 0  # the first launch is still made (and reported), then the replay stops
    storage = f"sqlite:///{folder / f'dsopt-{seed}.db'}"
    spec = grid.spec
    with contextlib.suppress(StopReplay), contextlib.redirect_stderr(io.StringIO()):  # the table only
        run_study(spec=spec, storage=storage, n_trials=None, timeout_s=None, runner=runner,
                  reference=lambda: [], sampler=optuna.samplers.TPESampler(seed=seed),
                  replayed_reference=None if reference is None else lambda _candidate: as_result(grid, reference))
    study = optuna.load_study(study_name=spec.name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    base = baseline_candidate(spec.training)
    def refused(held: bool) -> set[str]:
        return {candidate_of(t.user_attrs["candidate"], base).label() for t in trials
                if t.state is optuna.trial.TrialState.PRUNED and bool(t.user_attrs.get("held")) is held
                and ("does not fit" in t.user_attrs.get("pruned_reason", "") or held)} - set(run.launched)

    run.false_prunes = sum(1 for label in refused(False) if _fits(grid, grid.entries[label]))
    run.held_fits = sum(1 for label in refused(True) if _fits(grid, grid.entries[label]))
    models = study_models(spec=spec, trials=trials, base=base)
    run.spearman = spearman_of(grid, models.rates)
    return run


def _fits(grid: Grid, entry: dict) -> bool:
    return entry["outcome"] == "ok" and not grid.oom(entry)


def spearman_of(grid: Grid, rates) -> float | None:
    """Spearman's ρ between predicted and measured tokens/s over the ok candidates of the grid the model can
    predict (a figure no launched trial exercised, e.g. CPU Adam before any offload trial, stays unknown)."""
    base = baseline_candidate(grid.spec.training)
    predicted, measured = [], []
    for entry in grid.entries.values():
        if entry["outcome"] != "ok":
            continue
        candidate = candidate_of(entry["knobs"], base)
        job = work(candidate=candidate, model=grid.spec.model, hardware=grid.spec.hardware,
                   training=grid.spec.training)
        step = predict(job=job, rates=rates, ranks=grid.spec.hardware.world_size)
        if not isinstance(step, StepTime):
            continue
        predicted.append(step.tokens_per_s)
        measured.append(entry["tokens_per_s"])
    return spearman(predicted, measured) if len(predicted) >= 3 else None


def run_random(grid: Grid, seed: int) -> Run:
    labels = sorted(grid.entries)
    random.Random(seed).shuffle(labels)
    run = Run(launched=[])
    for label in labels:
        run.launch(grid, label)
        if run.reached_at is not None:
            break
    return run


def run_tpe(grid: Grid, seed: int) -> Run:
    spec = grid.spec
    space = branches(spec)
    base = baseline_candidate(spec.training)
    study = optuna.create_study(directions=["minimize", "maximize"], sampler=optuna.samplers.TPESampler(seed=seed))
    run = Run(launched=[])
    seen: dict[str, tuple[float, float] | None] = {}
    for _ in range(5000):
        if run.reached_at is not None or sum(label in grid.entries for label in seen) == len(grid.entries):
            break
        trial = study.ask()
        label = sample_candidate(trial, space, base).label()
        if label not in seen and label not in grid.entries:  # invalid (not recorded: DeepSpeed refuses it before
            seen[label] = None                              # any work): told as a failure, not counted as a launch
        elif label not in seen:
            entry = run.launch(grid, label)
            seen[label] = None if not _fits(grid, entry) else (
                float(entry["measured_peak_bytes"]), float(entry["tokens_per_s"]))
        values = seen[label]
        if values is None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, list(values))
    return run


def run_autotuner(grid: Grid) -> Run:
    """DeepSpeed's Autotuner walk (module doc, benchmarks/autotuner_walk.py), launching through the grid."""
    run = Run(launched=[])

    def launch(candidate: Candidate) -> float:
        entry = run.launch(grid, candidate.label())
        return entry["tokens_per_s"] if _fits(grid, entry) else 0.0

    autotuner_walk(grid.spec, run=launch, reached=lambda: run.reached_at is not None)
    return run


def summarize(name: str, runs: list[Run], grid: Grid, *, reference: str | None = None) -> str:
    """One table row; a run that never reached the target counts as infinitely many launches. ``reference``: the
    label of the FP32 reference run the strategy records before its first launch (dsopt's), if any."""
    total = len(grid.entries)
    launches = sorted(float("inf") if r.reached_at is None else r.reached_at for r in runs)
    never = sum(1 for r in runs if r.reached_at is None)

    def text(value: float) -> str:
        return "never" if value == float("inf") else f"{value:g} ({value / total:.0%})"

    longest = max((len(r.launched) for r in runs if r.reached_at is None), default=0)
    worst = text(launches[-1]) + (f" — {never} of {len(runs)} runs never, after {longest} launches" if never else "")
    ooms, false, held = [r.ooms(grid) for r in runs], [r.false_prunes for r in runs], [r.held_fits for r in runs]
    rho = [r.spearman for r in runs if r.spearman is not None]
    def speed(label: str | None) -> float:
        entry = grid.entries.get(label) if label else None
        return entry["tokens_per_s"] if entry is not None and grid.feasible(entry) else 0.0

    bar = FIRST_WITHIN * grid.best_tokens_per_s
    first = sum(1 for r in runs if r.launched and speed(r.launched[0]) >= bar)
    known = sum(1 for r in runs if max(speed(r.launched[0] if r.launched else None), speed(reference)) >= bar)
    return (f"| {name} | {len(runs)} | {text(statistics.median(launches))} | {worst} | "
            f"{statistics.median(ooms):g} (max {max(ooms)}) | {statistics.median(false):g} (max {max(false)}) | "
            f"{statistics.median(held):g} (max {max(held)}) | "
            + (f"{statistics.median(rho):.2f}" if rho else "-")
            + f" | {first} of {len(runs)} | {known} of {len(runs)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", nargs="+", default=[str(p) for p in GRIDS], help="recorded grid(s)")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--budget", nargs="+", default=None, metavar="SIZE",
                        help="replay at these per-rank budgets instead of the study's (e.g. '9 MB' '12 MB')")
    parser.add_argument("--strategy", nargs="+", choices=list(STRATEGIES.values()), default=list(STRATEGIES.values()),
                        help="replay only these strategies (default: all)")
    parser.add_argument("--without-probe", action="store_true",
                        help="replay as if the grid carried no probe of its machine (the time model from trials only)")
    parser.add_argument("--without-reference", action="store_true",
                        help="replay as if the FP32 reference run measured nothing the study records (before "
                             "2026-12-07 the replays did not record it)")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    budgets = [parse_bytes(text) for text in args.budget] if args.budget else [None]
    code = 0
    for path in args.grid:
        for budget in budgets:
            try:
                report(Path(path), seeds=args.seeds, budget_bytes=budget, strategies=args.strategy,
                       probe=not args.without_probe, with_reference=not args.without_reference)
            except NothingFeasible as error:  # the other budgets and grids are still reported
                print(f"search_efficiency.py: {error}", file=sys.stderr)
                code = 2
    return code


def report(path: Path, *, seeds: int, budget_bytes: int | None, strategies: list[str], probe: bool = True,
           with_reference: bool = True) -> None:
    """The grid's summary and the strategies' table."""
    grid = load_grid(path, budget_bytes=budget_bytes, probe=probe)
    spec = grid.spec
    entries = list(grid.entries.values())
    feasible = [e for e in entries if grid.feasible(e)]
    best = max(feasible, key=lambda e: e["tokens_per_s"])
    static_false = sum(1 for e in entries if _fits(grid, e) and not evaluate(
        candidate=candidate_of(e["knobs"], baseline_candidate(spec.training)), model=spec.model,
        hardware=spec.hardware, training=spec.training).fits)
    measured_fit = sum(1 for e in entries if _fits(grid, e))
    recorded_on = json.loads(path.read_text())["machine"]
    pins = recorded_on.get("kernels_pinned")  # record_grid.py: torch's and oneDNN's kernels pinned, where they were
    machine = recorded_on["cpu"] + (" (kernels pinned: " + ", ".join(f"{k}={v}" for k, v in pins.items()) + ")"
                                    if pins else "")
    print(f"\ngrid {path.name}: {len(entries)} candidates on {machine}; "
          f"{len(feasible)} feasible, {sum(grid.oom(e) for e in entries)} OOM (device share > "
          f"{spec.hardware.gpu_memory_bytes / 1e6:g} MB per rank); best {best['tokens_per_s']:,.0f} tokens/s "
          f"({best['label']}); target ≥ {TARGET:.0%} = {TARGET * best['tokens_per_s']:,.0f} tokens/s; "
          f"{sum(grid.hit(e) for e in entries)} candidate(s) reach it")
    reference = reference_entry(grid) if with_reference else None
    print("dsopt's FP32 reference run (recorded as a trial before its first launch; that launch not counted): "
          + ("none recorded" if reference is None else
             f"{reference['label']}, " + ("feasible" if grid.feasible(reference) else "not feasible")
             + (f", {reference['tokens_per_s'] / best['tokens_per_s']:.0%} of the best's speed"
                if reference["outcome"] == "ok" else f", {reference['outcome']}")))
    print(f"uncalibrated traced ledger: {static_false} false prune(s) of {measured_fit} candidates measured to "
          f"fit ({static_false / max(1, measured_fit):.1%})")
    before = profile_rates(hardware=spec.hardware)
    rho = spearman_of(grid, before)
    print(f"time model before any trial ({before.source}): "
          + (f"Spearman ρ {rho:.2f}\n" if rho is not None else "predicts no candidate's speed\n"))
    print("| strategy | runs | launches to ≥98% best, median | worst | OOM launches | false prunes | "
          "held, never launched, measured to fit | time-model Spearman ρ | "
          f"first launch ≥ {FIRST_WITHIN:.0%} of best | "
          f"best known after it ≥ {FIRST_WITHIN:.0%} (reference included) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        runs = {"dsopt": lambda: [run_dsopt(grid, seed, Path(folder), with_reference=with_reference)
                                  for seed in range(seeds)],
                "autotuner walk": lambda: [run_autotuner(grid)],
                "TPE, no ledger": lambda: [run_tpe(grid, seed) for seed in range(seeds)],
                "random": lambda: [run_random(grid, seed) for seed in range(seeds)]}
        rows = [summarize(name, run(), grid, reference=reference["label"] if name == "dsopt" and reference else None)
                for name, run in runs.items() if STRATEGIES[name] in strategies]
    print("\n".join(rows), flush=True)


if __name__ == "__main__":
    sys.exit(main())
