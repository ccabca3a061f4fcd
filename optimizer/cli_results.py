"""The commands that read a finished or running study's storage: ``dsopt export``, ``dsopt pareto``,
``dsopt dashboard`` (parsing is :mod:`optimizer.cli`'s; each is one library call and its printing)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from optimizer.errors import UserError
from optimizer.storage import load_stored_study, redact
from optimizer.study_file import StudySpec, load_study

if TYPE_CHECKING:
    import optuna


def stored_study(study: StudySpec, storage: str | None) -> optuna.Study:
    """The study's stored trials, read-only: a missing file or a database without Optuna's tables is refused
    (:func:`optimizer.storage.load_stored_study`), never created."""
    return load_stored_study(name=study.name, default_path=study.output_dir / "study.db", storage=storage,
                             study_path=study.path)


def export(args: argparse.Namespace) -> int:
    from optimizer.export import construction_advice, export_text, exported_config, write_atomically
    from optimizer.pareto import pick_trial

    study = load_study(args.study)
    stored = stored_study(study, args.storage)
    trial = pick_trial(stored, args.pick)
    config = exported_config(spec=study, knobs=trial.user_attrs["candidate"], hf=args.hf)
    out = Path(args.out) if args.out else study.output_dir / f"ds_config.{args.pick.replace('=', '')}" \
        f"{'.hf' if args.hf else ''}.json"
    write_atomically(out, export_text(config), force=args.force)
    attrs = trial.user_attrs
    print(f"picked trial #{trial.number} ({args.pick}): {attrs.get('candidate')}")
    print(f"measured: training memory {trial.values[0] / 1e6:.3f} MB per device (10^6 bytes), "
          f"{trial.values[1]:,.0f} tokens/s, "
          f"loss fidelity {attrs.get('loss_fidelity', float('nan')):.1e}"
          + (f" (reused from trial #{attrs['reused_from']})" if "reused_from" in attrs else ""))
    kind = "Hugging Face Trainer variant: batch sizes and optimizer params = auto" if args.hf else "DeepSpeed config"
    print(f"wrote {out} ({kind}; validated by DeepSpeed's parser)")
    print(construction_advice(spec=study, knobs=attrs["candidate"]))
    return 0


def pareto(args: argparse.Namespace) -> int:
    from optimizer.pareto import front_table
    from optimizer.pareto_plot import write_html, write_png

    study = load_study(args.study)
    stored = stored_study(study, args.storage)
    out = Path(args.out) if args.out else study.output_dir
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(source="--out", key=str(out), why=f"cannot create the folder: {err.strerror}") from None
    budget = study.hardware.gpu_memory_bytes
    print(front_table(stored, budget_bytes=budget))
    png = write_png(stored, out / "pareto.png", budget_bytes=budget)
    html = write_html(stored, out / "pareto.html", budget_bytes=budget)
    print(f"wrote {png} and {html}")
    return 0


def dashboard(args: argparse.Namespace) -> int:
    """``dsopt dashboard``: optuna-dashboard on the study's storage, with its trials' files (launchers/artifacts.py)."""
    from optuna.artifacts import FileSystemArtifactStore

    from launchers.artifacts import default_store_dir

    study = load_study(args.study)
    stored = stored_study(study, args.storage)  # readable, never created
    try:
        from optuna_dashboard import run_server
    except ImportError:
        raise UserError(source="dsopt dashboard", key="optuna-dashboard",
                        why="not installed: pip install 'dsopt[dashboard]' (or optuna-dashboard)") from None
    folder = default_store_dir(study.output_dir)
    store = FileSystemArtifactStore(folder) if folder.is_dir() else None
    print(f"dsopt: optuna-dashboard for study {study.name} at http://{args.host}:{args.port}/ (storage "
          f"{redact(args.storage or str(study.output_dir / 'study.db'))}; trial files "
          f"{folder if store else 'none yet'}); Ctrl-C stops it", flush=True)
    run_server(stored._storage, host=args.host, port=args.port, artifact_store=store)  # the opened storage
    return 0
