"""The refusal of PEFT's fp32 adapters beside a bf16 ``modules_to_save`` copy at ZeRO-3 bf16
(:func:`optimizer.study.constraints.mixed_trainable_dtypes`) is DeepSpeed's own failure, seen on a model built as the HF
Trainer builds it (tests/real/deepspeed/mixed_dtypes_rank.py, no dsopt code), and the ways out it names train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from two_ranks import run_two_ranks

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
LLAMA = HERE.parents[2] / "examples" / "tiny-llama" / "config.json"


def test_deepspeed_fails_at_initialize_where_the_constraint_refuses_and_trains_where_it_does_not(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    run_two_ranks(HERE / "mixed_dtypes_rank.py", str(LLAMA), str(tmp_path))
    for rank in (0, 1):
        def case(name: str, rank: int = rank) -> dict:
            return json.loads((tmp_path / f"{name}.rank{rank}.json").read_text())

        failed = case("zero_init")
        assert failed["trainable_dtypes"] == ["torch.bfloat16", "torch.float32"], failed
        assert not failed["ok"] and failed["error_type"] == "AssertionError", failed
        assert failed["file"].endswith("deepspeed/runtime/zero/utils.py") and failed["line"] == 218, failed
        offloaded = case("zero_init_offload")
        assert not offloaded["ok"] and offloaded["error_type"] == "RuntimeError", offloaded
        assert "same dtype" in offloaded["message"], offloaded
        for fine in ("zero_init_no_save", "built_whole"):  # the adapters alone; the engine's cast of a whole model
            result = case(fine)
            assert result["ok"] and result["loss"] > 0, result
        assert case("zero_init_no_save")["trainable_dtypes"] == ["torch.float32"]
