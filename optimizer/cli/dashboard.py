"""``dsopt dashboard STUDY``: optuna-dashboard on the study's storage, with each launched trial's files."""

from __future__ import annotations

import argparse

from optimizer.cli.common import positive_int, stored
from optimizer.search.storage import redact
from optimizer.study.errors import UserError
from optimizer.study.study_file import load_study


def run(args: argparse.Namespace) -> int:
    """``dsopt dashboard``: optuna-dashboard on the study's storage, with its trials' files
    (launchers/study/artifacts.py)."""
    from optuna.artifacts import FileSystemArtifactStore

    from launchers.study.artifacts import default_store_dir

    study = load_study(args.study)
    _, opened = stored(study, args.storage)  # readable, never created
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
    run_server(opened, host=args.host, port=args.port, artifact_store=store)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    dashboard = sub.add_parser("dashboard", help="optuna-dashboard on the study's storage, with each trial's "
                               "DeepSpeed JSON, result and log tail (pip install 'dsopt[dashboard]')")
    dashboard.add_argument("study", help="study file")
    dashboard.add_argument("--storage", default=None, help="Optuna storage URL (default: the study's sqlite file)")
    dashboard.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    dashboard.add_argument("--port", type=positive_int, default=8080, help="port (default 8080)")
    dashboard.set_defaults(run=run)
