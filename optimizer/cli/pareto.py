"""``dsopt pareto STUDY``: the measured Pareto front as a table, ``pareto.png`` and ``pareto.html``."""

from __future__ import annotations

import argparse
from pathlib import Path

from optimizer.cli.common import stored_study
from optimizer.study.errors import UserError
from optimizer.study.study_file import load_study


def run(args: argparse.Namespace) -> int:
    from launchers.trace.study_traces import with_traced_activations
    from optimizer.results.pareto import front_table
    from optimizer.results.pareto_plot import write_html, write_png
    from optimizer.search.untried import untried_options, untried_text
    from optimizer.study.specs import TransformerModel

    study = load_study(args.study)
    stored = stored_study(study, args.storage)
    out = Path(args.out) if args.out else study.output_dir
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(source="--out", key=str(out), why=f"cannot create the folder: {err.strerror}") from None
    budget = study.hardware.gpu_memory_bytes
    print(front_table(stored, budget_bytes=budget, headroom=study.budget.headroom_for(study.hardware.accelerator)))
    untried = untried_options(with_traced_activations(study), stored.get_trials(deepcopy=False)) \
        if isinstance(study.model, TransformerModel) else []
    print(untried_text(untried))
    points = [(o.assessment.need_bytes / 1e6, o.tokens_per_s or 0.0,
               f"{o.candidate.label()} — untried, probability to fit {o.assessment.fit_probability:.0%}")
              for o in untried]
    png = write_png(stored, out / "pareto.png", budget_bytes=budget, untried=points)
    html = write_html(stored, out / "pareto.html", budget_bytes=budget, untried=points)
    print(f"wrote {png} and {html}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    pareto = sub.add_parser("pareto", help="print the Pareto front and write pareto.png / pareto.html")
    pareto.add_argument("study", help="study file")
    pareto.add_argument("--storage", default=None, help="Optuna storage URL (default: the study's sqlite file)")
    pareto.add_argument("--out", default=None, help="output folder (default: studies/NAME/)")
    pareto.set_defaults(run=run)
