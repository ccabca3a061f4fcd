"""What one candidate holds at its measured peak on 2 CPU ranks, tensor by tensor, beside the ledger's items.

    python benchmarks/peak_attribution.py studies/grid-cpu.yaml --set zero_stage=2 --set micro_batch_size=4

Runs the candidate's real trial once (:mod:`launchers.rank.peak_attribution`: the trial's rank program with the
profiler recording call stacks) and prints, per rank, the measured training peak (c10's all-thread counter),
the op during which it fell, and the allocations live then grouped by where they were made (the largest
first); then the ledger's items at each phase. This is how the ledger's ZeRO-1/2 terms were checked term by
term (docs/ledger.md "Known limits"). The live listing pairs main-thread events by address, so its sum can exceed the
peak by what gloo's threads had already freed. ``--frames N`` keeps N frames of each site's stack (default 6; 40 shows
a recomputation's whole path, e.g. ``recompute_fn <- unpack_hook <- linear.py(108): backward``). Prints only;
asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from launchers.trace.study_traces import with_traced_activations
from launchers.trial.local import extensions_dir, free_port
from launchers.trial.run import rank_plan
from optimizer.ledger.core import evaluate
from optimizer.study.knobs import KNOB_NAMES, parse_knob, with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study")
    parser.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                        help=f"a knob (repeatable): {', '.join(KNOB_NAMES)}; others take the baseline")
    parser.add_argument("--top", type=int, default=20, help="allocation sites printed per rank")
    parser.add_argument("--frames", type=int, default=6, help="frames of each site's stack kept (innermost first)")
    args = parser.parse_args()
    study = with_traced_activations(load_study(Path(args.study)))
    knobs = {name: parse_knob(name, value) for name, _, value in (pair.partition("=") for pair in args.set)}
    candidate = with_knobs(baseline_candidate(study.training), knobs)
    verdict = evaluate(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)
    if verdict.ledger is None:
        print(f"{candidate.label()}: invalid: {'; '.join(verdict.invalid_reasons)}", file=sys.stderr)
        return 2
    ranks = study.hardware.gpus_per_node
    with tempfile.TemporaryDirectory(prefix="dsopt-attribution-") as folder:
        out = Path(folder)
        (out / "plan.json").write_text(json.dumps(rank_plan(study=study, candidate=candidate)))
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(extensions_dir()),
                   DSOPT_ATTRIBUTION_FRAMES=str(args.frames),
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(args.study).resolve().parent)]))
        argv = [torchrun, "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1", "--master_port",
                str(free_port()), "-m", "launchers.rank.peak_attribution", str(out / "plan.json"), str(out)]
        done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        print(f"{study.name} · {candidate.label()} · {ranks} CPU ranks (bytes)")
        for rank in range(ranks):
            report = json.loads((out / f"attribution.rank{rank}.json").read_text())
            print(f"\nrank {rank}: training peak {report['peak_bytes']:,} (paired live {report['paired_live_bytes']:,})"
                  f" during {report['at'][:150 * args.frames // 6]}")
            for size, count, site in report["groups"][:args.top]:
                print(f"  {size:>12,} {count:>4}× {site[:170 * args.frames // 6]}")
    ledger = verdict.ledger
    print(f"\nledger: peak phase {ledger.peak_phase}, per-rank training peak {ledger.training_bytes:,}")
    for item in ledger.items:
        print(f"  {item.bytes:>12,} {item.location:5} {item.phase:9} {item.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
