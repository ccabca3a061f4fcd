"""The DeepSpeed JSON builder: DeepSpeed's own parser accepts every config; golden files; the ledger contract."""

from __future__ import annotations

import json
import os

import pytest

from optimizer.deepspeed.config import build_ds_config
from optimizer.deepspeed.validate import InvalidDeepSpeedConfig, validate_with_deepspeed
from optimizer.ledger.core import compute_ledger, evaluate
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

GOLDEN = {
    "gpt2-tiny-cpu": [
        {"zero_stage": 0},
        {"zero_stage": 1, "offload_optimizer": "cpu", "precision": "bf16", "micro_batch_size": 2},
        {"zero_stage": 2, "checkpointing": "full"},
        {"zero_stage": 3, "precision": "bf16", "micro_batch_size": 8},
    ],
    "llama-7b-8xh100": [
        {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "cpu", "precision": "bf16"},
        {"zero_stage": 2, "precision": "fp16", "micro_batch_size": 2},
    ],
}


def _config(study, knobs):
    candidate = with_knobs(baseline_candidate(study.training), knobs)
    return build_ds_config(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)


@pytest.mark.parametrize("name", ["gpt2-tiny-cpu", "llama-7b-8xh100"])
def test_deepspeed_parses_every_valid_config_of_the_space(repo_root, name):
    study = load_study(repo_root / "studies" / f"{name}.yaml")
    spec = {"model": study.model, "hardware": study.hardware, "training": study.training}
    checked = 0
    for candidate in study.search_space.candidates(baseline_candidate(study.training)):
        if evaluate(candidate=candidate, **spec).ledger is None:
            continue
        validate_with_deepspeed(build_ds_config(candidate=candidate, **spec), world_size=study.hardware.world_size)
        checked += 1
    assert checked > 100


def test_deepspeeds_parser_catches_mistakes(repo_root):
    config = _config(load_study(repo_root / "studies" / "gpt2-tiny-cpu.yaml"), {"zero_stage": 2})
    for broken in ({**config, "zero_optimization": {**config["zero_optimization"], "stage": 5}},
                   {**config, "zero_optimization": {**config["zero_optimization"], "reduce_bucket": 1}},
                   {**config, "train_batch_size": 3}):
        with pytest.raises(InvalidDeepSpeedConfig):
            validate_with_deepspeed(broken, world_size=2)


@pytest.mark.parametrize(("name", "index"), [(n, i) for n, cases in GOLDEN.items() for i in range(len(cases))])
def test_golden_configs(repo_root, name, index):
    study = load_study(repo_root / "studies" / f"{name}.yaml")
    config = _config(study, GOLDEN[name][index])
    path = repo_root / "tests" / "golden" / f"{name}-{index}.json"
    if os.environ.get("DSOPT_UPDATE_GOLDEN"):
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    assert config == json.loads(path.read_text()), f"regenerate with DSOPT_UPDATE_GOLDEN=1 if intended: {path}"


def test_batch_fields_keep_the_global_batch(repo_root):
    study = load_study(repo_root / "studies" / "gpt2-tiny-cpu.yaml")
    for mbs in (1, 2, 4, 8):
        config = _config(study, {"micro_batch_size": mbs})
        assert config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * 2 == 16


def test_the_ledger_counts_the_buckets_the_builder_sets(repo_root):
    study = load_study(repo_root / "studies" / "gpt2-tiny-cpu.yaml")
    for knobs, g in (({"zero_stage": 2}, 4), ({"zero_stage": 3, "precision": "bf16"}, 2)):
        candidate = with_knobs(baseline_candidate(study.training), knobs)
        config = build_ds_config(candidate=candidate, model=study.model, hardware=study.hardware,
                                 training=study.training)
        ledger = compute_ledger(candidate=candidate, model=study.model, hardware=study.hardware,
                                training=study.training)
        bucket = next(i for i in ledger.items if i.name.startswith("gradient bucket"))
        assert bucket.bytes == g * config["zero_optimization"]["reduce_bucket_size"]
        assert config["zero_optimization"]["reduce_bucket_size"] == study.model.hidden_size ** 2
