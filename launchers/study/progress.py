"""How a running study reports: ``human`` (one line per finished trial on stderr, and on a terminal a live
status line kept at the bottom with tqdm), ``quiet`` (only what the worker says when it starts waiting or
stops, and errors) or ``jsonl`` (one JSON object per finished trial on stdout, for scripts; nothing else on
stdout). The lines' format is :mod:`optimizer.search.progress`'s.
"""

from __future__ import annotations

import json
import sys
import time
from enum import StrEnum
from typing import Any, TextIO

import optuna

from optimizer.search.progress import counts, eta_s, status_text, trial_line, trial_summary
from optimizer.study.knobs import Candidate


class ProgressMode(StrEnum):
    """What a study prints while it runs (module doc)."""

    HUMAN = "human"
    QUIET = "quiet"
    JSONL = "jsonl"


class Progress:
    """One worker's report of its trials: :meth:`started` when a launch begins, :meth:`finished` (an Optuna
    callback) when a trial ends, :meth:`say` for the worker's own messages, :meth:`close` at the end."""

    def __init__(self, mode: ProgressMode = ProgressMode.HUMAN, *, base: Candidate, target: int | None,
                 worker: str, err: TextIO | None = None, out: TextIO | None = None) -> None:
        self.mode = mode
        self.base = base
        self.target = target
        self.worker = worker
        self.err = err if err is not None else sys.stderr
        self.out = out if out is not None else sys.stdout
        self.ran = 0
        self.launches = 0
        self.now: str | None = None
        self.wall_s: list[float] = []
        self._started: float | None = None
        self._counts: dict[str, int] = {}
        self._best: tuple[int, float] | None = None
        self._bar: Any = None
        if mode is ProgressMode.HUMAN and getattr(self.err, "isatty", lambda: False)():
            from tqdm import tqdm  # optuna's own dependency

            self._bar = tqdm(total=None, file=self.err, bar_format="{desc}", leave=False)
            self._refresh()

    def _write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.err)
        else:
            print(text, file=self.err, flush=True)

    def _refresh(self) -> None:
        if self._bar is not None:
            left = None if self.target is None else self.target - self.launches
            self._bar.set_description_str(status_text(
                counts=self._counts, ran=self.ran, launches=self.launches, target=self.target, now=self.now,
                best=self._best,
                eta_s=eta_s(wall_s=self.wall_s, left=left) if left is not None else None))

    def say(self, text: str) -> None:
        """The worker's own message (setting up, waiting, stopping): shown in every mode but ``jsonl``, where it
        goes to stderr all the same (stdout carries only the records)."""
        self._write(f"[{self.worker}] {text}")

    def launched(self, launches: int) -> None:
        """This worker's real launches so far (retries and the FP32 reference included): what ``--n-trials``
        counts."""
        self.launches = launches
        self._refresh()

    def started(self, candidate: Candidate) -> None:
        """A launch of ``candidate`` begins."""
        self.now = candidate.label()
        self._started = time.monotonic()
        self._refresh()

    def finished(self, study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        """Optuna's callback: report the trial that just ended (and the study's counts and front)."""

        if self._started is not None:
            self.wall_s.append(time.monotonic() - self._started)
            self._started = None
        self.ran += 1
        self.now = None
        front = study.best_trials
        self._counts = counts(study)
        fastest = max(front, key=lambda t: t.values[1]) if front else None
        self._best = (fastest.number, fastest.values[1]) if fastest else None
        summary = trial_summary(frozen, base=self.base, on_front=any(t.number == frozen.number for t in front))
        if self.mode is ProgressMode.JSONL:
            print(json.dumps(summary), file=self.out, flush=True)
        elif self.mode is ProgressMode.HUMAN:
            self._write(trial_line(summary))
        self._refresh()

    def close(self) -> None:
        """Remove the status line."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
