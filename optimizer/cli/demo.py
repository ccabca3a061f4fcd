"""``dsopt demo``: a small real study on 2 CPU ranks, then the export and the Pareto plots."""

from __future__ import annotations

import argparse
import sys

from optimizer.cli.common import positive_int, prepared_study, runnable_model
from optimizer.study.study_file import load_study


def run(args: argparse.Namespace) -> int:
    from launchers.study.demo import DEMO_STUDY, run_demo
    from launchers.trial.run import ReferenceFailed, check_devices
    from optimizer.results.pareto import front_table, headroom_lines

    study = load_study(args.study or DEMO_STUDY)  # checked, with its devices, before anything is built or run
    runnable_model(study, what="run")
    check_devices(study)
    study = prepared_study(study)
    print(f"dsopt demo: {study.path}, {study.hardware.gpus_per_node} {study.hardware.accelerator} ranks, until "
          f"{args.n_trials} launches (the FP32 reference included)", file=sys.stderr)
    try:
        demo = run_demo(spec=study, n_trials=args.n_trials)
    except ReferenceFailed as failed:
        print(f"dsopt: {failed}; see {study.output_dir / 'reference' / 'log.txt'}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM/SIGHUP under `dsopt` (launchers.process.termination)
        from launchers.process.termination import exit_status, interrupt_name

        print(f"dsopt: {interrupt_name(interrupt)}; run the demo again to continue", file=sys.stderr)
        return exit_status(interrupt)
    c, trial = demo.counts, demo.picked
    budget = study.hardware.gpu_memory_bytes
    headroom = study.budget.headroom_for(study.hardware.accelerator)
    print(front_table(demo.study, budget_bytes=budget, headroom=headroom))
    by_reference = sum(1 for t in demo.study.get_trials(deepcopy=False) if "measured_by" in t.user_attrs)
    launched = f" ({by_reference} of them by the FP32 reference's own launch)" if by_reference else ""
    print(f"\ntrials: {c['measured']} measured{launched}, {c['reused']} reused, {c['pruned']} pruned by the "
          f"ledger (never launched), {c['held']} held (risky proposals of the sampler, not launched then), "
          f"{c['failed']} failed (oom included); wall "
          f"time {demo.wall_s:.0f} s")
    label = trial.user_attrs.get("label", trial.user_attrs["candidate"])
    print(f"picked (balanced): trial #{trial.number} {label}: {trial.values[0] / 1e6:.3f} MB per rank, "
          f"{trial.values[1]:,.0f} tokens/s, loss fidelity {trial.user_attrs['loss_fidelity']:.1e}")
    print("\n".join(headroom_lines(demo.study, picked=trial, how="balanced", budget_bytes=budget, headroom=headroom)))
    print(f"DeepSpeed config: {demo.config_path}\nPareto plots: {demo.png_path}, {demo.html_path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="a small real study on 2 CPU ranks, then export and Pareto plots")
    demo.add_argument("--study", default=None, help="study file (default: studies/demo-cpu.yaml)")
    demo.add_argument("--n-trials", type=positive_int, default=16, help="launches to reach, retries and the FP32 "
                      "reference included (default 16)")
    demo.set_defaults(run=run)
