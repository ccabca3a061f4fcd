"""Every launched trial's files in Optuna's artifact store, so ``optuna-dashboard`` shows them beside the trial:
the DeepSpeed JSON the trial ran (``ds_config.json``), its result (``result.json``) and the last lines of its
log (``log-tail.txt``), uploaded as the launch returns (the objective's ``after_launch`` hook). The store is a
folder beside the study by default (``studies/NAME/artifacts/``, :class:`optuna.artifacts.FileSystemArtifactStore`);
on a cluster a folder on the shared filesystem serves every worker. A trial reused from another, pruned or held
launched nothing and uploads nothing; a file the trial did not write (a launch that failed before DeepSpeed
started) is skipped. An upload that fails is reported and the study goes on: the files stay in the trial's
folder (``trial_dir``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import optuna

from launchers.trial.local import log_tail

UPLOADED = ("ds_config.json", "result.json")
"""Files of a trial's folder uploaded as they are."""
LOG_TAIL_CHARS = 8000
"""Characters of the end of ``log.txt`` uploaded as ``log-tail.txt``."""


def default_store_dir(output_dir: Path) -> Path:
    """``studies/NAME/artifacts``."""
    return output_dir / "artifacts"


def upload_trial_files(trial: optuna.Trial, *, store_dir: Path) -> list[str]:
    """Upload the files of ``trial``'s launch (the trial still running: Optuna records an artifact on the trial,
    which a finished trial no longer takes) to the store at ``store_dir``; the names uploaded."""
    folder = trial.user_attrs.get("trial_dir")
    if not folder:
        return []
    trial_dir = Path(folder)
    store_dir.mkdir(parents=True, exist_ok=True)
    store = optuna.artifacts.FileSystemArtifactStore(store_dir)
    uploaded = []
    for name in UPLOADED:
        path = trial_dir / name
        if path.is_file():
            optuna.artifacts.upload_artifact(artifact_store=store, file_path=str(path), study_or_trial=trial,
                                             mimetype="application/json")
            uploaded.append(name)
    log = trial_dir / "log.txt"
    if log.is_file():
        with tempfile.TemporaryDirectory(prefix="dsopt-log-") as tmp:
            tail = Path(tmp) / "log-tail.txt"
            tail.write_text(log_tail(log, limit=LOG_TAIL_CHARS))
            optuna.artifacts.upload_artifact(artifact_store=store, file_path=str(tail), study_or_trial=trial,
                                             mimetype="text/plain", encoding="utf-8")
        uploaded.append("log-tail.txt")
    return uploaded


def uploader(store_dir: Path, *, warn: Callable[[str], None]) -> Callable[[optuna.Trial], None]:
    """The objective's ``after_launch`` hook: upload the trial's files; a failed upload is one warning, not a
    stop (the files stay in the trial's folder)."""
    def upload(trial: optuna.Trial) -> None:
        try:
            upload_trial_files(trial, store_dir=store_dir)
        except (OSError, ValueError, RuntimeError, optuna.exceptions.OptunaError) as error:
            warn(f"trial {trial.number}: its files stay in {trial.user_attrs.get('trial_dir')}; uploading them "
                 f"to {store_dir} failed: {type(error).__name__}: {error}")
    return upload
