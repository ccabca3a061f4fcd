"""Every model-state item of fifteen candidates, whole: name, formula, bytes, place, phase, kind and DeepSpeed
citation (optimizer/ledger/model_states.py, on a CUDA device so that no CPU-rank item enters), as
tests/data/model_state_items.json lists them.

Seven ("hand") are worked by hand, below. The model is grid-cpu's GPT (tests/
test_zero12_phases.py counts it by hand): Ψ = 120,576 on N = 2 ranks, P = Q = S = Ψ/2 = 60,288 (no padding: Ψ is
a multiple of 2N), the largest tensor Lₜ = 64·256 = 16,384 elements, the bucket B = h² = 4,096 and the worst
rank's gradient partition Σ = 70,400 elements (its own tensors in full). ZeRO-3: the persistent parameters K =
1,792 elements (every tensor ≤ 640 elements: per block ln_1 and ln_2 2·2·64, the c_attn bias 192, the c_proj
biases 2·64, the c_fc bias 256 = 832, × 2 blocks, + ln_f 128), the largest module LL = the c_fc Linear, 64·256 +
256 = 16,640 elements, prefetch and reuse 0.9·h² = 3,686 elements (DeepSpeed's "auto" sizes,
optimizer/deepspeed/zero_settings.py). Global batch 8 at micro-batch 2 on 2 ranks: two micro-batches a step.

The figures, by hand: 2Ψ = 241,152, 4Ψ = 482,304, 8Ψ = 964,608; 2P = 120,576, 4P = 241,152, 6P = 361,728,
8P = 482,304 (Q and S alike); 2Σ = 140,800, 4Σ = 281,600; 2·B = 8,192, 4·B = 16,384; 2Lₜ = 32,768,
4Lₜ = 65,536, 8Lₜ = 131,072 (ZeRO-1/2's step: max(8Lₜ, 6P) = 361,728 in bf16, max(8Lₜ, 4P) = 241,152 in fp32;
ZeRO-2 offload's fp64 norm 8Lₚ with the piece Lₚ = Lₜ = 131,072); 2K = 3,584; 2·2·LL = 66,560; 2 × 3,686 = 7,372;
ZeRO-3 offload's boundary gradient 2·⌈Lₜ/N⌉ + 8·⌈Lₜ/N⌉ = 10 · 8,192 = 81,920. Why each item is there, and where
DeepSpeed allocates it, is in model_states.py's citations and docs/ledger.md.

The other paths ("snapshot": NVMe offload of both states, fp32 with the optimizer on the host, ZeRO-2 offload at
one micro-batch a step, fp16's loss-scaled optimizers, ZeRO-1 offload; "one_rank": ZeRO-2 and ZeRO-3 on one rank,
global batch 4, where ZeRO-3 gathers views of the partition, not copies — 0-byte items, partition_parameters.py:
61-75, 1559-1560) were recorded from the ledger on 2026-12-03 and read against model_states.py's formulas (e.g. the
NVMe parameter files 2Q = 120,576 and DeepSpeed's swap buffers 5 · 1e8 · 2 = 1,000,000,000): a regression pin,
not worked anew by hand.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from optimizer.ledger.core import compute_ledger
from optimizer.ledger.items import Category
from optimizer.ledger.transformer import parameter_count
from optimizer.study.knobs import Precision, parse_knob, with_knobs
from optimizer.study.specs import ActivationSource, baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]

ITEMS = json.loads((ROOT / "tests" / "data" / "model_state_items.json").read_text(encoding="utf-8"))


def _knobs(label: str) -> dict:
    """'z2 bf16 ckpt=none mbs=2 opt->cpu param->cpu' → the knobs."""
    words = label.split()
    knobs = {"zero_stage": int(words[0][1]), "precision": words[1], "micro_batch_size": int(words[3][4:])}
    for word in words[4:]:
        name, device = word.split("->")
        knobs["offload_optimizer" if name == "opt" else "offload_param"] = device
    return {name: parse_knob(name, str(value)) if name != "micro_batch_size" else value
            for name, value in knobs.items()}


@pytest.fixture(scope="module")
def study():
    study = load_study(ROOT / "studies" / "grid-cpu.yaml")
    assert parameter_count(study.model) == 120_576
    model = dataclasses.replace(study.model, activations=ActivationSource.FORMULA)
    gpu = dataclasses.replace(study.hardware, accelerator="cuda",
                              supported_precisions=(Precision.FP32, Precision.BF16, Precision.FP16))
    return dataclasses.replace(study, model=model, hardware=gpu)


def _items(study, label: str, **hardware) -> list[list]:
    training = dataclasses.replace(study.training, global_batch_size=4) if hardware.get("gpus_per_node") == 1 \
        else study.training
    candidate = with_knobs(baseline_candidate(training), _knobs(label))
    assert candidate.label() == label
    ledger = compute_ledger(candidate=candidate, model=study.model,
                            hardware=dataclasses.replace(study.hardware, **hardware), training=training)
    assert ledger.risks == ()  # nothing sometimes-live off CPU ranks
    return [[i.bytes, i.location.value, i.phase.value, i.category.value, i.formula, i.name, i.source]
            for i in ledger.items if i.category is not Category.ACTIVATIONS]


@pytest.mark.parametrize("label", list(ITEMS["hand"]))
def test_every_model_state_item_as_worked_by_hand(study, label):
    assert _items(study, label) == ITEMS["hand"][label]


@pytest.mark.parametrize("label", list(ITEMS["snapshot"]))
def test_the_other_paths_as_recorded(study, label):
    assert _items(study, label, nvme_path="/nvme") == ITEMS["snapshot"][label]


@pytest.mark.parametrize("label", list(ITEMS["one_rank"]))
def test_one_rank_as_recorded(study, label):
    assert _items(study, label, gpus_per_node=1) == ITEMS["one_rank"][label]
