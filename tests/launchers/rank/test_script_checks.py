"""What the script hook checks without a rank (launchers/rank/script_checks.py): which process it measures,
the engine against the candidate, recomputation against ``checkpointing``, the batch a forward sees."""

from __future__ import annotations

import torch

from launchers.rank.script_checks import (
    batch_shape,
    checkpointing_mismatch,
    engine_mismatches,
    offload_device,
    wanted,
)

EXPECT = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "zero_stage": 3, "precision": "bf16",
          "offload_optimizer": "cpu", "offload_param": "none", "checkpointing": "full", "checkpoint_calls": 4}


def test_only_a_rank_torchrun_started_and_no_child_of_it_is_measured():
    rank = {"DSOPT_HOOK_PLAN": "/t/plan.json", "LOCAL_RANK": "0", "GROUP_RANK": "0"}
    assert wanted(rank)
    assert not wanted({k: v for k, v in rank.items() if k != "GROUP_RANK"})  # torchrun's agent
    assert not wanted({**rank, "DSOPT_HOOK_ACTIVE": "123"})  # a process the measured rank spawned
    assert not wanted({**rank, "DSOPT_HOOK_PLAN": ""})


def test_every_knob_the_engine_runs_otherwise_is_named():
    actual = {**EXPECT, "zero_stage": 2, "precision": "fp32"}
    assert engine_mismatches({"expect": EXPECT}, actual) == [
        "zero_stage: the candidate's is 3, the script's engine runs 2",
        "precision: the candidate's is bf16, the script's engine runs fp32"]
    assert engine_mismatches({"expect": EXPECT}, dict(EXPECT)) == []


def test_the_offload_device_is_read_from_deepspeeds_own_parsed_zero_config():
    # DeepSpeed 0.19.8 keeps the device as a plain string (use_enum_values): reading `.device.value` crashed every
    # script trial whose candidate or FP32 reference offloads.
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = DeepSpeedZeroConfig(stage=3, offload_optimizer={"device": "cpu"}, offload_param={"device": "nvme",
                                                                                           "nvme_path": "/tmp"})
    assert (offload_device(zero.offload_optimizer), offload_device(zero.offload_param)) == ("cpu", "nvme")
    assert offload_device(DeepSpeedZeroConfig(stage=2).offload_optimizer) == "none"
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    class EnumSection:  # a release that keeps the enum member
        device = OffloadDeviceEnum.cpu

    assert offload_device(EnumSection()) == "cpu"


def test_recomputation_is_counted_per_forward():
    plan = {"expect": EXPECT}
    assert checkpointing_mismatch(plan, [4, 4]) is None
    assert "checkpointed 0" in checkpointing_mismatch(plan, [0, 0])
    assert "(4 checkpointed block(s) per forward), the script's forward checkpointed 2" in \
        checkpointing_mismatch(plan, [2])
    none = {"expect": {**EXPECT, "checkpointing": "none", "checkpoint_calls": 0}}
    assert checkpointing_mismatch(none, [0]) is None
    assert "the candidate's is none, the script's forward checkpointed 4" in checkpointing_mismatch(none, [4])
    unknown = {"expect": {**EXPECT, "checkpointing": "selective", "checkpoint_calls": None}}
    assert checkpointing_mismatch(unknown, [3]) is None
    assert checkpointing_mismatch(plan, []) is None  # no forward seen: nothing to say yet


def test_the_batch_a_forward_sees():
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert batch_shape((), {"input_ids": ids, "labels": ids}) == (64, 4)
    assert batch_shape((ids,), {}) == (64, 4)
    assert batch_shape(({"input_ids": ids[:2]},), {}) == (32, 2)
    assert batch_shape((torch.zeros(4, 8),), {}) == (None, None)  # floating inputs: no tokens to count


def test_why_a_script_ended_early_names_what_the_hook_saw():
    from launchers.rank.script_checks import ended_early

    assert ended_early(engine_seen=False, frozen_engines=0, done=0, warmup=2, measured=3).startswith(
        "the script never called deepspeed.initialize")
    only_frozen = ended_early(engine_seen=False, frozen_engines=1, done=0, warmup=2, measured=3)
    assert "1 DeepSpeed engine(s) without an optimizer" in only_frozen and "none that trains" in only_frozen
    short = ended_early(engine_seen=True, frozen_engines=1, done=3, warmup=2, measured=3)
    assert "ended after 3 optimizer step(s); the trial measures 5" in short and "{max_steps}" in short
