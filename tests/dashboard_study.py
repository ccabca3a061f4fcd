"""A finished small study with trial files, and ``dsopt dashboard`` serving it — shared by the dashboard tests.

The study is cpu-tiny run through ``run_study`` with a runner that writes what a real launch writes into the
trial's folder and reports figures that trade memory for speed by micro-batch (no DeepSpeed: the study, its
artifact store and the dashboard are under test, not the trial)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import optuna

from launchers.study.artifacts import LOG_TAIL_CHARS
from launchers.study.progress import ProgressMode
from launchers.study.study_run import run_study
from launchers.trial.local import free_port
from launchers.trial.run import trial_dir_for
from optimizer.ledger.core import evaluate
from optimizer.results.trial_result import Outcome, RankMeasurement, TrialResult
from optimizer.study.study_file import StudySpec


def studied(spec: StudySpec, *, n_trials: int = 4) -> optuna.Study:
    """``n_trials`` trials of ``spec`` through run_study; a launch of micro-batch b reports a device share of
    (1 + b)·10^5 bytes (its peak is that + the ledger's host items, which CPU ranks measure in the same memory)
    and 1000·b tokens/s, so each micro-batch launched is a point of the front."""
    def runner(candidate, _reference):
        folder = trial_dir_for(spec, candidate)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "ds_config.json").write_text(json.dumps({"label": candidate.label()}))
        (folder / "result.json").write_text(json.dumps({"outcome": "ok"}))
        (folder / "log.txt").write_text("x" * LOG_TAIL_CHARS + "the last line\n")
        b = candidate.micro_batch_size
        ledger = evaluate(candidate=candidate, model=spec.model, hardware=spec.hardware, training=spec.training).ledger
        assert ledger is not None
        peak = ledger.training_host_share_bytes + (1 + b) * 10**5
        rank = RankMeasurement(rank=0, peak_allocated_bytes=peak, peak_reserved_bytes=None, peak_rss_bytes=0,
                               step_times_s=(0.1,), training_peak_allocated_bytes=peak)
        return TrialResult(outcome=Outcome.OK, ranks=(rank,), step_time_s=0.1 / b, tokens_per_s=1000.0 * b,
                           loss_fidelity=0.0, losses=(5.0,))

    return run_study(spec=spec, storage=f"sqlite:///{spec.output_dir / 'study.db'}", n_trials=n_trials,
                     timeout_s=None, runner=runner, reference=lambda: [5.0], progress=ProgressMode.QUIET)


@contextlib.contextmanager
def dashboard(study_path: Path) -> Iterator[str]:
    """``dsopt dashboard STUDY`` on a free port; yields its base URL once its API answers; stopped after."""
    port = free_port()
    dsopt = Path(sys.executable).parent / "dsopt"
    server = subprocess.Popen([str(dsopt), "dashboard", str(study_path), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            try:
                urllib.request.urlopen(f"{base}/api/studies", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None:
                    raise AssertionError(f"dsopt dashboard exited: {server.stdout.read()}") from None
                time.sleep(0.2)
        else:
            raise AssertionError("the dashboard did not answer in 30 s")
        yield base
    finally:
        server.terminate()
        server.wait(timeout=10)
