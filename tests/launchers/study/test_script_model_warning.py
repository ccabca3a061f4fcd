"""A script study whose script trains another model than the model section plans: said once per worker."""

from __future__ import annotations

from launchers.study.study_run import say_script_model
from optimizer.ledger.transformer import parameter_count
from optimizer.results.trial_result import Outcome, TrialResult
from optimizer.study.study_file import load_study


def test_a_script_model_unlike_the_plan_is_said_once(repo_root, capsys):
    spec = load_study(repo_root / "studies" / "cpu-tiny.yaml")
    planned = parameter_count(spec.model)
    said: list[str] = []
    same = TrialResult(outcome=Outcome.OK, script_parameters=planned)
    say_script_model(spec, same, said=said, worker="w")
    assert said == [] and capsys.readouterr().err == ""
    other = TrialResult(outcome=Outcome.OK, script_parameters=planned + 4096)
    for _ in range(2):
        say_script_model(spec, other, said=said, worker="w")
    err = capsys.readouterr().err
    assert err.count("warning: the script trains") == 1 and f"{planned + 4096:,} parameters" in err
    assert f"plans {planned:,}" in err
    say_script_model(spec, TrialResult(outcome=Outcome.OK), said=said, worker="w")  # dsopt's own step: nothing
    assert capsys.readouterr().err == ""


def test_a_script_that_freezes_what_the_study_trains_is_said_once(repo_root, capsys):
    # a PEFT script tuned with a study that plans a full fine-tune: the same model, another trainable count
    spec = load_study(repo_root / "studies" / "cpu-tiny.yaml")
    planned = parameter_count(spec.model)
    said: list[str] = []
    say_script_model(spec, TrialResult(outcome=Outcome.OK, script_parameters=planned,
                                       script_trainable_parameters=planned), said=said, worker="w")
    assert said == [] and capsys.readouterr().err == ""
    lora = TrialResult(outcome=Outcome.OK, script_parameters=planned, script_trainable_parameters=1024)
    for _ in range(2):
        say_script_model(spec, lora, said=said, worker="w")
    err = capsys.readouterr().err
    assert err.count("warning: 1,024 of the script's") == 1 and f"the study plans {planned:,}" in err
    assert "model.peft or training.frozen" in err
