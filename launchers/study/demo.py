"""``dsopt demo``: a small real study on 2 CPU ranks, then the export and the Pareto plots.

Resumable: it runs until the study has made ``n_trials`` launches (retries and the FP32 reference included),
so running it again continues (or,
when the study is complete, only rewrites the export and the plots).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import optuna

from launchers.study.study_run import default_storage, run_study
from optimizer.results.export import export_text, exported_config, write_atomically
from optimizer.results.pareto import pick_trial
from optimizer.results.pareto_plot import write_html, write_png
from optimizer.search.coordination import REFERENCE_LAUNCHES_ATTR, launches_used
from optimizer.search.progress import counts
from optimizer.study.study_file import StudySpec

DEMO_STUDY = Path(__file__).resolve().parents[2] / "studies" / "demo-cpu.yaml"


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoResult:
    """What the demo produced."""

    study: optuna.Study
    picked: optuna.trial.FrozenTrial
    config_path: Path
    png_path: Path
    html_path: Path
    counts: dict[str, int]
    wall_s: float


def run_demo(*, spec: StudySpec, n_trials: int) -> DemoResult:
    """Run the study to ``n_trials`` launches (retries and the reference included), export the balanced pick,
    draw the front."""
    start = time.monotonic()
    storage = default_storage(spec)
    finished = 0
    if (spec.output_dir / "study.db").exists():
        existing = optuna.load_study(study_name=spec.name, storage=storage)
        finished = launches_used(existing.get_trials(deepcopy=False),
                                 reference_launches=int(existing.user_attrs.get(REFERENCE_LAUNCHES_ATTR, 0)))
    study = run_study(spec=spec, storage=storage, n_trials=max(0, n_trials - finished), timeout_s=None)
    picked = pick_trial(study, "balanced", budget_bytes=spec.hardware.gpu_memory_bytes,
                        headroom=spec.budget.headroom_for(spec.hardware.accelerator))
    config_path = spec.output_dir / "ds_config.balanced.json"
    config = exported_config(spec=spec, knobs=picked.user_attrs["candidate"], hf=False)
    write_atomically(config_path, export_text(config), force=True)
    png = write_png(study, spec.output_dir / "pareto.png", budget_bytes=spec.hardware.gpu_memory_bytes)
    html = write_html(study, spec.output_dir / "pareto.html", budget_bytes=spec.hardware.gpu_memory_bytes)
    return DemoResult(study=study, picked=picked, config_path=config_path, png_path=png, html_path=html,
                      counts=counts(study), wall_s=time.monotonic() - start)
