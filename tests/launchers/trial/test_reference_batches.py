"""Which FP32 reference a candidate is judged against: the study's, or, where dropout draws masks per micro-batch,
the one at the candidate's own micro-batch size (launchers/trial/reference_batches.py; the real runs that show the
masks' noise and its cure are in tests/real/deepspeed/test_trials.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from launchers.trial.reference_batches import (
    at_micro_batch,
    draws_random,
    judge_for,
    kept_as_reference,
    losses_for,
    reference_drew,
    reference_name,
)
from launchers.trial.run import reference_candidate, reference_key
from optimizer.results.trial_result import Outcome, TrialResult
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]


def _study(tmp_path: Path, name: str):
    """A copy of a study whose model is inline (its outputs go under ``tmp_path``)."""
    shutil.copy(ROOT / "studies" / f"{name}.yaml", tmp_path / f"{name}.yaml")
    return load_study(tmp_path / f"{name}.yaml")


@pytest.mark.parametrize(("name", "drawn"), [
    ("grid-lora-gpt2-cpu", True),  # transformers' GPT-2: resid/embd/attn_pdrop 0.1 by default
    ("grid-lora-llama-cpu", True),  # LoRA's lora_dropout 0.1 on a Llama without dropout
    ("grid-llama-cpu", False),  # the Llama: attention_dropout 0
    ("cpu-tiny", False),  # the built-in GPT with dropout: false
    ("seed-1b-2x24gb", False),  # a model given by its sizes only runs no trial
])
def test_the_studies_whose_training_draws_random_numbers(name, drawn):
    study = load_study(ROOT / "studies" / f"{name}.yaml")  # read only
    assert draws_random(study) is drawn
    other = 1 if study.training.micro_batch_size != 1 else 2
    assert reference_name(study, study.training.micro_batch_size) == "reference"
    assert reference_name(study, other) == (f"reference-mbs{other}" if drawn else "reference")


def test_the_built_in_model_with_dropout_draws_random_numbers(tmp_path):
    study = _study(tmp_path, "cpu-tiny")
    assert draws_random(dataclasses.replace(study, model=dataclasses.replace(study.model, dropout=True)))


def test_without_dropout_or_at_the_reference_micro_batch_the_study_reference_judges(tmp_path):
    for name, micro_batch in (("cpu-tiny", 1), ("grid-lora-gpt2-cpu", 2)):
        study = _study(tmp_path, name)
        candidate = with_knobs(baseline_candidate(study.training), {"zero_stage": 1, "micro_batch_size": micro_batch})
        given = [5.0, 4.9]
        judge = judge_for(study, candidate)
        assert judge.name == "reference" and judge.study is study and not judge.own
        assert losses_for(judge, given) is given  # nothing launched: no reference-mbs file appears
        assert not list(study.output_dir.glob("reference-mbs*")) if study.output_dir.exists() else True


def test_another_micro_batch_reads_its_own_cached_reference_under_its_key(tmp_path):
    study = _study(tmp_path, "grid-lora-gpt2-cpu")
    at = at_micro_batch(study, 4)
    assert at.training.micro_batch_size == 4 and at.training.global_batch_size == study.training.global_batch_size
    assert at.output_dir == study.output_dir and reference_candidate(at).micro_batch_size == 4
    assert reference_key(at) != reference_key(study)
    study.output_dir.mkdir(parents=True)
    (study.output_dir / "reference-mbs4.json").write_text(json.dumps({"key": reference_key(at), "losses": [5.5, 5.4]}))
    candidate = with_knobs(baseline_candidate(study.training), {"zero_stage": 2, "micro_batch_size": 4})
    said: list[str] = []
    assert losses_for(judge_for(study, candidate), [9.0], say=said.append) == [5.5, 5.4]
    assert said == []  # cached: no launch announced


def test_the_reference_candidate_of_another_micro_batch_is_its_own_reference(tmp_path):
    study = _study(tmp_path, "cpu-tiny")
    study = dataclasses.replace(study, model=dataclasses.replace(study.model, dropout=True))
    base = baseline_candidate(study.training)
    own = with_knobs(base, {"micro_batch_size": 1})  # z0 fp32 ckpt=none mbs=1: the mbs-1 reference's candidate
    assert reference_candidate(at_micro_batch(study, 1)) == own
    judge = judge_for(study, own)
    assert (judge.name, judge.study.training.micro_batch_size, judge.own) == ("reference-mbs1", 1, True)
    assert judge.launches == 0  # its own run is the reference: no launch besides it
    other = judge_for(study, with_knobs(own, {"zero_stage": 1}))
    assert not other.own and other.launches == 1  # judged by it, not it: the mbs-1 reference is launched first
    assert not judge_for(study, base).own  # the study's own reference: a study runs it in its setup
    assert judge_for(study, base).launches == judge_for(study, with_knobs(base, {"zero_stage": 1})).launches == 0
    held_by_none = judge_for(study, base, study_reference_held=False)  # dsopt trial: its run is the reference
    assert (held_by_none.name, held_by_none.study, held_by_none.own) == ("reference", study, True)
    result = kept_as_reference(judge, own, TrialResult(outcome=Outcome.OK, losses=(5.5, 5.4), loss_fidelity=None))
    assert result.loss_fidelity == 0.0
    assert losses_for(judge_for(study, with_knobs(own, {"zero_stage": 1})), [9.0]) == [5.5, 5.4]  # cached, its key
    assert judge_for(study, with_knobs(own, {"zero_stage": 1})).launches == 0  # cached: nothing more to launch
    assert not judge_for(study, own).own  # kept: its next launch is judged like any other
    failed = TrialResult(outcome=Outcome.OOM, loss_fidelity=None)
    assert kept_as_reference(judge, own, failed) is failed
    judged = TrialResult(outcome=Outcome.OK, losses=(5.5, 5.4), loss_fidelity=1e-8)
    assert kept_as_reference(judge_for(study, with_knobs(own, {"zero_stage": 1})), own, judged) is judged


def test_a_reference_run_that_drew_makes_each_micro_batch_judge_its_own(tmp_path):
    """A model whose dropout the study does not say (cpu-tiny: ``dropout: false``; a script's model given by its
    shape): once the cached FP32 reference says its training drew random numbers — whether it was launched as the
    reference or kept from its own candidate's trial — candidates at another micro-batch are judged against their
    own; a reference cached for another study (another key) says nothing."""
    study = _study(tmp_path, "cpu-tiny")
    assert not draws_random(study)
    base = baseline_candidate(study.training)
    result = TrialResult(outcome=Outcome.OK, losses=(5.0, 4.9), loss_fidelity=None, draws_random=True)
    kept_as_reference(judge_for(study, base, study_reference_held=False), base, result)  # dsopt trial's own run
    assert json.loads((study.output_dir / "reference.json").read_text())["draws_random"] is True
    assert draws_random(study) and reference_drew(study)
    candidate = with_knobs(base, {"zero_stage": 1, "micro_batch_size": 1})
    judge = judge_for(study, candidate)
    assert (judge.name, judge.launches) == ("reference-mbs1", 1)
    stale = json.loads((study.output_dir / "reference.json").read_text()) | {"key": "another study's"}
    (study.output_dir / "reference.json").write_text(json.dumps(stale))
    assert not reference_drew(study) and judge_for(study, candidate).name == "reference"


def test_the_rank_sees_dropout_draw_and_recomputation_not():
    """launchers/measure/rng_draws.py on a real module: a micro-step with dropout draws, one without does not, and
    recomputation under torch.utils.checkpoint leaves the generator as the forward left it."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from launchers.measure.rng_draws import DrawWatch

    def step(module: torch.nn.Module, *, recompute: bool = False) -> bool:
        watch = DrawWatch()
        watch.before()
        x = torch.ones(4, 8, requires_grad=True)
        out = checkpoint(module, x, use_reentrant=False) if recompute else module(x)
        out.sum().backward()
        watch.after()
        return watch.drew

    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    dropped = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1))
    assert not step(plain) and not step(plain, recompute=True)
    assert step(dropped) and step(dropped, recompute=True)
    assert not step(dropped.eval())
    skipped = DrawWatch()
    skipped.before(watch=False)
    dropped.train()(torch.ones(2, 8))
    skipped.after()
    assert not skipped.drew
