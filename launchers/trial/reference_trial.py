"""The FP32 reference run read back as a trial of its candidate: one launch, not two.

The reference (:func:`launchers.trial.run.reference_losses`) is a whole trial of :func:`reference_candidate` — the
same rank program, steps and measurements, only without a reference to compare with and without stop-above
limits. Where that candidate is one of the study's, its trial is the reference run itself: the ranks' reports are
read back from ``studies/NAME/reference/`` and summarised as :func:`launchers.trial.run.run_trial` summarises a
launch (:func:`optimizer.results.trial_result.summarize`), with the reference's own losses as the reference (a
fidelity of 0: it is the baseline), and its files are copied into the trial's folder. The objective records it
with no launch (:func:`optimizer.search.objective.make_objective`'s ``measured``), whatever the models predict of
it; its measurement is judged against the budget like any other.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from launchers.trial.run import cached_reference_losses, reference_candidate
from launchers.trial.script_trial import script_tokens_per_step, with_script_counts
from optimizer.results.trial_result import Outcome, TrialResult, summarize
from optimizer.study.knobs import Candidate
from optimizer.study.study_file import StudySpec

FILES = ("ds_config.json", "plan.json", "result.json", "log.txt")
"""What a trial's folder holds besides the ranks' reports, copied from the reference's."""


def reference_as_trial(study: StudySpec, candidate: Candidate, *, trial_dir: Path | None) -> TrialResult | None:
    """The reference run as the trial of ``candidate`` (module doc), its files copied into ``trial_dir`` (None: only
    whether there is one); None when ``candidate`` is not the reference's, or no reference run of this study as it
    is now is on disk (its cache key: another model, candidate or library version measured something else)."""
    losses = cached_reference_losses(study)
    if losses is None or candidate != reference_candidate(study):
        return None
    folder = study.output_dir / "reference"
    try:
        recorded = json.loads((folder / "result.json").read_text())
        reports = {rank: json.loads((folder / f"rank{rank}.json").read_text())
                   for rank in range(study.hardware.world_size)}
    except (OSError, ValueError):
        return None
    if recorded.get("outcome") != Outcome.OK.value or list(reports[0].get("losses", ())) != losses:
        return None  # not the run the cached losses came from
    result = summarize(rank_reports=reports, world_size=study.hardware.world_size, returncode=0, timed_out=False,
                       tokens_per_step=script_tokens_per_step(study, reports), reference_losses=losses, log_tail="",
                       wall_s=float(recorded.get("wall_s") or 0.0))
    if result.outcome is not Outcome.OK:
        return None
    result = with_script_counts(study, result, reports)
    if trial_dir is None:
        return result
    trial_dir.mkdir(parents=True, exist_ok=True)
    for name in (*FILES, *(f"rank{rank}.json" for rank in reports)):
        if (folder / name).is_file():
            shutil.copyfile(folder / name, trial_dir / name)
    return result
