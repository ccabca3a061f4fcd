"""``trial.command``: placeholders, the rule that every searched knob reaches the script, the filled command line,
and the study file's errors (file, key, why; exit 2)."""

from __future__ import annotations

import textwrap
from dataclasses import replace

import pytest

from optimizer.cli import main
from optimizer.study.errors import UserError
from optimizer.study.knobs import EveryKCheckpointing, FullCheckpointing, Precision, ZeroStage
from optimizer.study.script_command import ScriptCommand, command_values, placeholders, substitute, uncovered_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

STUDY = """
name: mine
model:
  kind: transformer
  layers: 4
  hidden_size: 64
  heads: 4
  vocab_size: 256
hardware:
  accelerator: cpu
  gpus_per_node: 2
  gpu_memory: 1 GiB
training:
  global_batch_size: 16
  micro_batch_size: 2
  sequence_length: 32
trial:
  command: {command}
{extra}
search_space:
  knobs:
    zero_stage: [0, 3]
    precision: [fp32, bf16]
    checkpointing: [none, full]
    micro_batch_size: [1, 2]
"""
PLAIN = '[python, train.py, --deepspeed_config, "{ds_config}", --ckpt, "{checkpointing}"]'


def _study(tmp_path, command=PLAIN, extra="", script=True):
    if script:
        (tmp_path / "train.py").write_text("print('hello')\n")
    path = tmp_path / "mine.yaml"
    path.write_text(textwrap.dedent(STUDY).replace("{command}", command).replace("{extra}", extra))
    return path


def test_placeholders_are_read_and_literal_braces_kept():
    assert placeholders(["--x", "{ds_config}", "a{{b}}c", "--mbs={micro_batch_size}"]) == \
        {"ds_config", "micro_batch_size"}
    assert substitute(["a{{b}}c", "--mbs={micro_batch_size}"], {"micro_batch_size": "4"}) == ("a{b}c", "--mbs=4")


@pytest.mark.parametrize(("argv", "why"), [
    (["train.py", "{ds_confg}"], "unknown placeholder {ds_confg}"),
    (["train.py", "{ds_config"], "a lone '{'"),
    (["train.py", "--mbs", "{micro_batch_size}"], "must pass {ds_config}"),
])
def test_a_bad_command_says_why(argv, why):
    with pytest.raises(ValueError, match=f".*{why.replace('{', '[{]').replace('}', '[}]')}"):
        ScriptCommand(argv=tuple(argv))


def test_a_plain_json_carries_everything_but_recomputation():
    command = ScriptCommand(argv=("train.py", "{ds_config}"))
    searched = {"zero_stage": ["0", "3"], "precision": ["fp32", "bf16"], "micro_batch_size": ["1", "2"],
                "checkpointing": ["none", "full"]}
    assert [m.split(" ")[0] for m in uncovered_knobs(command, searched)] == ["checkpointing"]
    on_off = ScriptCommand(argv=("train.py", "{ds_config}", "{gradient_checkpointing}"))
    assert uncovered_knobs(on_off, searched) == []
    # every_2 is not on/off: only {checkpointing} says it
    assert "needs {checkpointing}:" in uncovered_knobs(on_off, {**searched, "checkpointing": ["none", "every_2"]})[0]


def test_an_hf_json_needs_the_batch_and_precision_arguments():
    command = ScriptCommand(argv=("train.py", "{ds_config}", "{checkpointing}"), ds_config_style="hf")
    searched = {"precision": ["fp32", "bf16", "fp16"], "micro_batch_size": ["1", "2"]}
    missing = uncovered_knobs(command, searched)
    assert [m.split("needs ")[1].split(" in")[0] for m in missing] == [
        "{micro_batch_size}", "{gradient_accumulation_steps}", "{precision} or {bf16}", "{precision} or {fp16}"]
    covered = ScriptCommand(argv=("train.py", "{ds_config}", "{micro_batch_size}", "{gradient_accumulation_steps}",
                                  "--bf16", "{bf16}", "--fp16", "{fp16}"), ds_config_style="hf")
    assert uncovered_knobs(covered, searched) == []


def test_the_values_of_a_candidate(tmp_path):
    spec = load_study(_study(tmp_path))
    candidate = replace(baseline_candidate(spec.training), zero_stage=ZeroStage.PARAMETERS, precision=Precision.BF16,
                        checkpointing=EveryKCheckpointing(k=2), micro_batch_size=4)
    values = command_values(candidate=candidate, ds_config="/t/ds.json", trial_dir="/t", global_batch_size=16,
                            world_size=2, seed=7, max_steps=6, sequence_length=32)
    assert values == {"ds_config": "/t/ds.json", "trial_dir": "/t", "micro_batch_size": "4",
                      "gradient_accumulation_steps": "2", "global_batch_size": "16", "precision": "bf16",
                      "bf16": "true", "fp16": "false", "zero_stage": "3", "checkpointing": "every_2",
                      "gradient_checkpointing": "true", "seed": "7", "max_steps": "6", "sequence_length": "32"}
    full = replace(candidate, checkpointing=FullCheckpointing())
    assert command_values(candidate=full, ds_config="", trial_dir="", global_batch_size=16, world_size=2, seed=0,
                          max_steps=1, sequence_length=1)["checkpointing"] == "full"


def test_a_study_with_a_command_loads(tmp_path):
    spec = load_study(_study(tmp_path))
    assert spec.trial.command is not None and spec.trial.command.names == {"ds_config", "checkpointing"}


@pytest.mark.parametrize(("command", "extra", "script", "key", "why"), [
    ('[python, train.py, "{ds_config}"]', "", True, "trial.command", "checkpointing (searched: none, full) needs"),
    ('"python train.py {ds_config}"', "", True, "trial.command", "expected a list of strings"),
    ('[python, train.py, 3, "{ds_config}"]', "", True, "trial.command", "every argument must be a string"),
    ('[python, train.py, "{ds_config}", "{checkpointing}", "{lr}"]', "", True, "trial.command",
     "unknown placeholder {lr}"),
    (PLAIN, "", False, "trial.command", "script 'train.py' not found"),
    (PLAIN, "  ds_config_style: deepspeed", True, "trial.ds_config_style", "must be one of plain, hf"),
    (PLAIN, "  tokens_per_sample: -3", True, "trial.tokens_per_sample", ""),
])
def test_a_bad_script_study_is_one_error_naming_the_key(tmp_path, command, extra, script, key, why):
    path = _study(tmp_path, command=command, extra=extra, script=script)
    with pytest.raises(UserError) as err:
        load_study(path)
    assert err.value.key == key and why in err.value.why
    before = set(tmp_path.rglob("*"))
    assert main(["ledger", str(path)]) == 2
    assert set(tmp_path.rglob("*")) == before  # nothing half-written


def test_script_keys_without_a_command_are_refused(tmp_path):
    path = _study(tmp_path)
    path.write_text(path.read_text().replace("  command: " + PLAIN, "  ds_config_style: hf"))
    with pytest.raises(UserError) as err:
        load_study(path)
    assert err.value.key == "trial.ds_config_style" and "only a study with trial.command" in err.value.why
