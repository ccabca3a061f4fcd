"""The drawn study (optimizer/results/pareto_plot.py): the budget line, labelled front points, a measured OOM where it
was measured, held and pruned candidates at their prediction, untried ones at their predicted need and speed."""

from __future__ import annotations

import optuna

from optimizer.results.pareto_plot import _groups, budget_label, write_html, write_png

TrialState = optuna.trial.TrialState


def _study() -> optuna.Study:
    study = optuna.create_study(directions=["minimize", "maximize"])
    feasible = {"constraints:loss_fidelity": -0.01, "constraints:init_memory": -0.5}
    study.add_trial(optuna.trial.create_trial(values=[2_500_000.0, 900.0], system_attrs=feasible,
                                              user_attrs={"label": "a", "predicted_bytes": 2_400_000}))
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={
        "label": "b", "outcome": "oom", "predicted_bytes": 2_900_000, "device_share_bytes": 3_137_072}))
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={
        "label": "c", "outcome": "crash", "predicted_bytes": 1_000_000}))
    study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED, user_attrs={
        "label": "d", "held": True, "predicted_bytes": 2_950_000, "pruned_reason": "held: ..."}))
    study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED, user_attrs={
        "label": "e", "predicted_bytes": 3_400_000, "pruned_reason": "does not fit: ..."}))
    return study


def test_each_trial_is_drawn_where_it_belongs():
    groups = _groups(_study())
    assert [p[:2] for p in groups["front"]] == [(2.5, 900.0)]
    assert sorted(p[:2] for p in groups["failed"]) == [(1.0, 0.0), (3.137072, 0.0)]  # the OOM where it measured
    assert [p[:2] for p in groups["held"]] == [(2.95, 0.0)] and [p[:2] for p in groups["pruned"]] == [(3.4, 0.0)]
    assert budget_label(3_000_000) == "per-device budget 3.000 MB"
    assert _groups(_study())["untried"] == [] and _groups(_study(), UNTRIED)["untried"] == list(UNTRIED)


UNTRIED = ((2.96, 1200.0, "z0 bf16 ckpt=full mbs=4 — untried, probability to fit 77%"),)


def test_the_plots_show_the_budget_and_the_untried(tmp_path):
    study = _study()
    png = write_png(study, tmp_path / "pareto.png", budget_bytes=3_000_000, untried=UNTRIED)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    html = write_html(study, tmp_path / "pareto.html", budget_bytes=3_000_000, untried=UNTRIED).read_text()
    assert "per-device budget 3.000 MB" in html and "held: a risky proposal of the sampler" in html
    assert "untried, may fit" in html and "probability to fit 77%" in html
