"""Your own training script as the trial (``trial.command``), for real on CPU ranks: each example (a plain
DeepSpeed loop, the HF Trainer, Accelerate) is tuned, exported and trained again without dsopt as measured; a
script that trains with a config of its own and a script that never calls DeepSpeed are one clear error each."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from optimizer.cli import main

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
DSOPT = [sys.executable, "-m", "optimizer.cli"]


def _examples(tmp_path: Path) -> Path:
    """A copy of examples/ without study outputs (they go beside the study file)."""
    def outputs(folder: str, names: list[str]) -> list[str]:
        depth = len(Path(folder).relative_to(ROOT / "examples").parts)
        return [n for n in names if depth == 1 and (Path(folder) / n).is_dir()]

    return Path(shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=outputs))


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """A dsopt command that starts no process, run in this one (the same ``main`` the console script calls): what
    it returns and prints."""
    capsys.readouterr()
    code = main(list(args))
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def _dsopt(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DSOPT, *args], capture_output=True, text=True, timeout=900, check=False, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize(("example", "name", "ranks"), [
    ("plain_deepspeed", "plain-deepspeed", 2),
    ("hf_trainer", "hf-trainer", 1),  # the Trainer runs DeepSpeed in one CPU process only (docs/trials.md)
    ("accelerate", "accelerate", 2),
    ("peft_lora", "peft-lora", 1),  # HF Trainer + PEFT LoRA: the study's model.peft is the script's LoraConfig
    ("qlora_trainer", "qlora-trainer", 1),  # + bitsandbytes 4-bit: model.quantization is its BitsAndBytesConfig
    # TRL's DPOTrainer: its reference's engine (no optimizer) made first, pairs of rows, TRL's fused head
    ("trl_dpo", "trl-dpo", 1),
    ("trl_sft", "trl-sft", 1),  # TRL's SFTTrainer with a PEFT peft_config and its fused head
])
def test_an_example_is_tuned_and_its_export_trains_without_dsopt_as_measured(tmp_path, capsys, example, name, ranks):
    pytest.importorskip("transformers")
    if example == "qlora_trainer":
        pytest.importorskip("bitsandbytes")
    if example.startswith("trl_"):
        pytest.importorskip("trl")
    study = _examples(tmp_path) / example / "study.yaml"
    run = _dsopt("study", "run", str(study), "--n-trials", "2", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert re.search(r"feasible Pareto front: [1-9]", run.stdout), run.stdout
    code, printed, errors = _cli(capsys, "pareto", str(study))
    assert code == 0 and (study.parent / name / "pareto.png").is_file(), printed + errors
    out = tmp_path / "ds_config.json"
    code, exported, errors = _cli(capsys, "export", str(study), "--pick", "fastest", "--out", str(out))
    assert code == 0, exported + errors
    line = re.search(r"train with it .*?: (.*)", exported).group(1)
    planned = re.search(r"planned for: (.*)", exported).group(1)
    assert ("PEFT LoRA r=8" in planned) is (example in ("peft_lora", "qlora_trainer", "trl_sft")), planned
    assert ("4-bit nf4" in planned) is (example == "qlora_trainer"), planned
    assert str(out) in line and "{max_steps}" in line, line
    label = re.search(r"picked trial #\d+ \(fastest\): (.*)", exported).group(1)
    measured = json.loads(next((study.parent / name / "trials").glob(label.replace(" ", "_") + "*/result.json"))
                          .read_text())
    trial_peak = max(r["peak_allocated_bytes"] for r in measured["ranks"])
    if example.startswith("trl_"):  # the plan is of what TRL runs: TRL's head and its tile (DPO: pairs of rows and
        # the reference)
        knobs = re.fullmatch(r"z(\d) (\w+) ckpt=(\S+) mbs=(\d+)", label).groups()
        sets = [a for k, v in zip(("zero_stage", "precision", "checkpointing", "micro_batch_size"), knobs, strict=True)
                for a in ("--set", f"{k}={v}")]
        code, ledger, errors = _cli(capsys, "ledger", str(study), *sets, "--json")
        assert code == 0, errors
        planned_peak = json.loads(ledger)["per_gpu"]["total"]
        assert abs(planned_peak - trial_peak) <= 0.03 * trial_peak, (planned_peak, trial_peak)
    # The script, given the exported JSON and the arguments the export printed, run without dsopt.
    args = shlex.split(line.replace("{max_steps}", "6").replace("{trial_dir}", str(tmp_path / "plain")))[2:]
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
         str(29700 + ranks * 10 + len(example)), str(ROOT / "tests" / "scripts" / "measured_run.py"), str(tmp_path),
         "train.py", *args], capture_output=True, text=True, timeout=600, check=False, cwd=study.parent,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
             "OMP_NUM_THREADS": "1"})
    assert plain.returncode == 0, plain.stdout + plain.stderr[-3000:]
    # per step (accelerate on CPU ranks counts one process, so each rank prints as the main one), or the Trainer's log
    by_step = {int(step): float(loss) for step, loss in re.findall(r"step (\d+) loss ([\d.]+)", plain.stdout)}
    losses = list(by_step.values()) or [float(x) for x in re.findall(r"'loss': '?([\d.]+)", plain.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0], plain.stdout
    plain_peak = max(json.loads((tmp_path / f"peak{r}.json").read_text())["peak"] for r in range(ranks))
    assert abs(plain_peak - trial_peak) <= 0.02 * trial_peak, (plain_peak, trial_peak)


@pytest.mark.parametrize(("script", "why"), [
    ("own_config.py", "NotTheCandidate: the script's DeepSpeed engine is not the candidate's (does the script pass "
                      "{ds_config} to DeepSpeed?): micro_batch_size: the candidate's is 2, the script's engine runs 1"),
    ("no_deepspeed.py", "ScriptEnded: the script never called deepspeed.initialize"),
])
def test_a_script_that_is_not_measurable_is_one_clear_error(tmp_path, script, why):
    examples = _examples(tmp_path)
    shutil.copy(ROOT / "tests" / "scripts" / script, examples / "plain_deepspeed" / script)
    study = examples / "plain_deepspeed" / "study.yaml"
    text = study.read_text()
    text = re.sub(r"command: \[.*?\]", f'command: [python, {script}, --deepspeed_config, "{{ds_config}}"]', text,
                  flags=re.S).replace("checkpointing: [none, full]", "checkpointing: [none]")
    study.write_text(text)
    run = _dsopt("study", "run", str(study), "--n-trials", "2", cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    # one error line; the tracing progress line comes too where this test runs first on the session's cache
    errors = [line for line in run.stderr.splitlines()
              if line.startswith("dsopt:") and not line.startswith("dsopt: tracing the model")]
    assert len(errors) == 1 and why in errors[0], run.stderr


def test_a_script_trial_of_an_offloaded_candidate_checks_its_engine_and_trains(tmp_path):
    # The hook reads the engine's offload devices; DeepSpeed 0.19.8 holds them as plain strings, and reading
    # `.device.value` crashed rank 0 of every script trial that offloads (the candidate or the FP32 reference).
    pytest.importorskip("transformers")
    study = _examples(tmp_path) / "plain_deepspeed" / "study.yaml"
    run = _dsopt("trial", str(study), "--set", "zero_stage=3", "--set", "offload_optimizer=cpu", "--set",
                 "offload_param=cpu", "--set", "precision=fp32", "--set", "checkpointing=none", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    result = json.loads(next((study.parent / "plain-deepspeed" / "trials").glob("z3_*/result.json")).read_text())
    assert result["outcome"] == "ok", result.get("message")
    assert all(r["gc_pause_s"] is not None for r in result["ranks"])  # the hook settled the heap and watched
    assert "agreement with the FP32 baseline" in run.stdout and "ok)" in run.stdout, run.stdout
    assert "cyclic GC from the first measured step on" in run.stdout, run.stdout


def test_a_script_model_s_undeclared_dropout_is_measured_and_each_micro_batch_judged_by_its_own(tmp_path):
    # The study plans examples/tiny-llama (attention_dropout 0) while the script trains a copy with dropout 0.1:
    # the FP32 reference's ranks see the generator advance in training (launchers/measure/rng_draws.py), so a
    # candidate at micro-batch 1 is judged against the reference at micro-batch 1 — same masks, fp32 agreement —
    # not against the study's at 2, which differs by the masks' noise.
    pytest.importorskip("transformers")
    examples = _examples(tmp_path)
    config = json.loads((examples / "tiny-llama" / "config.json").read_text())
    (examples / "dropout-llama").mkdir()
    (examples / "dropout-llama" / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    study = examples / "plain_deepspeed" / "study.yaml"
    study.write_text(study.read_text().replace('command: [python, train.py, ', 'command: [python, train.py, '
                                               '--model, ../dropout-llama, '))
    run = _dsopt("trial", str(study), "--set", "zero_stage=2", "--set", "micro_batch_size=1", "--set",
                 "precision=fp32", "--set", "checkpointing=none", "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    output = study.parent / "plain-deepspeed"
    reports = [json.loads(p.read_text()) for p in sorted((output / "reference").glob("rank*.json"))]
    assert len(reports) == 2 and all(r["draws_random"] for r in reports)  # both ranks saw the masks drawn
    assert json.loads((output / "reference.json").read_text())["draws_random"] is True
    assert (output / "reference-mbs1.json").is_file()
    data = json.loads(run.stdout)
    assert data["outcome"] == "ok" and data["loss_fidelity"] <= 1e-4, data
    losses, base = data["losses"], json.loads((output / "reference.json").read_text())["losses"]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, base, strict=True)) > 1e-4  # the masks' noise at mbs 2
