"""``dsopt export STUDY --pick …``: a measured trial's DeepSpeed JSON, validated by DeepSpeed's parser."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from optimizer.cli.common import stored_study
from optimizer.study.knobs import with_knobs
from optimizer.study.script_command import exported_command
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study


def run(args: argparse.Namespace) -> int:
    from optimizer.results.export import (
        construction_advice,
        export_text,
        exported_config,
        planned_setup,
        write_atomically,
    )
    from optimizer.results.pareto import headroom_lines, pick_trial

    study = load_study(args.study)
    stored = stored_study(study, args.storage)
    budget = study.hardware.gpu_memory_bytes
    headroom = study.budget.headroom_for(study.hardware.accelerator)
    trial = pick_trial(stored, args.pick, budget_bytes=budget, headroom=headroom)
    command = study.trial.command
    hf = args.hf or (command is not None and command.ds_config_style == "hf")  # the JSON the script takes
    config = exported_config(spec=study, knobs=trial.user_attrs["candidate"], hf=hf)
    out = Path(args.out) if args.out else study.output_dir / f"ds_config.{args.pick.replace('=', '')}" \
        f"{'.hf' if hf else ''}.json"
    write_atomically(out, export_text(config), force=args.force)
    attrs = trial.user_attrs
    print(f"picked trial #{trial.number} ({args.pick}): {attrs.get('label', attrs.get('candidate'))}")
    print(f"measured: training memory {trial.values[0] / 1e6:.3f} MB per device (10^6 bytes), "
          f"{trial.values[1]:,.0f} tokens/s, "
          f"loss fidelity {attrs.get('loss_fidelity', float('nan')):.1e}"
          + (f" (reused from trial #{attrs['reused_from']})" if "reused_from" in attrs else ""))
    print("\n".join(headroom_lines(stored, picked=trial, how=args.pick, budget_bytes=budget, headroom=headroom)))
    kind = "Hugging Face Trainer variant: batch sizes and optimizer params = auto" if hf else "DeepSpeed config"
    print(f"wrote {out} ({kind}; validated by DeepSpeed's parser)")
    print(planned_setup(study))
    if command is not None:
        line = exported_command(command, candidate=with_knobs(baseline_candidate(study.training), attrs["candidate"]),
                                ds_config=str(out), global_batch_size=study.training.global_batch_size,
                                world_size=study.hardware.world_size, seed=study.trial.seed,
                                sequence_length=study.training.sequence_length)
        print(f"train with it (on each rank, e.g. under torchrun or the deepspeed launcher): {shlex.join(line)}")
    else:
        print(construction_advice(spec=study, knobs=attrs["candidate"]))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", help="write a measured trial's DeepSpeed JSON")
    export.add_argument("study", help="study file")
    export.add_argument("--storage", default=None, help="Optuna storage URL (default: the study's sqlite file)")
    export.add_argument("--pick", default="balanced", help="fastest | smallest | balanced | trial=N")
    export.add_argument("--out", default=None, help="output path (default: studies/NAME/ds_config.PICK.json)")
    export.add_argument("--force", action="store_true", help="overwrite an existing file")
    export.add_argument("--hf", action="store_true", help="Hugging Face Trainer variant (batch sizes = auto)")
    export.set_defaults(run=run)
