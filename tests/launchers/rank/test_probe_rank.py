"""The probe rank's timing on this CPU (real torch) and its CUDA branch's arithmetic (a stand-in event clock: CUDA
events report milliseconds; no GPU here). tests/real/deepspeed/test_probe_real.py runs whole probes on 2 ranks."""

from __future__ import annotations

import types

import pytest
import torch

from launchers.rank import probe_rank
from launchers.rank.probe_rank import ROUND_S, ROUNDS, Timer, attention_rounds, copy_rounds, gemm_rounds

PLAN = {"rows_per_sample": 1, "sequence_length": 16, "gemm_shapes": [[32, 32, 3], [32, 64, 1]],
        "attention": [4, 4, 8, 2]}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_rounds_time_every_shape_and_attention(precision):
    timer = Timer(torch.device("cpu"))
    for eager in (True, False):
        seconds = attention_rounds(timer, {**PLAN, "eager_attention": eager}, device=torch.device("cpu"),
                                   precision=precision, micro_batch=2)
        assert len(seconds) == ROUNDS and all(s > 0 for s in seconds)
    seconds = gemm_rounds(timer, PLAN, device=torch.device("cpu"), precision=precision, micro_batch=2)
    assert len(seconds) == ROUNDS and all(s > 0 for s in seconds)
    host = copy_rounds(timer, size=1 << 16, device=torch.device("cpu"), pinned=False, to_device=True)
    assert len(host) == ROUNDS and all(s > 0 for s in host)


class _Clock:
    """CUDA events as the timer uses them: record(), synchronize(), elapsed_time() in milliseconds."""

    now_ms = 0.0

    def __init__(self, enable_timing: bool) -> None:
        assert enable_timing
        self.at = None

    def record(self) -> None:
        self.at = _Clock.now_ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _Clock) -> float:
        return end.at - self.at


def test_cuda_branch_reads_event_milliseconds_as_seconds_per_run(monkeypatch):
    timer = Timer(types.SimpleNamespace(type="cuda"))
    assert timer.cuda
    monkeypatch.setattr(timer, "torch", types.SimpleNamespace(cuda=types.SimpleNamespace(Event=_Clock)))
    calls = []

    def op() -> None:  # 2 ms of "GPU time" per run
        calls.append(1)
        _Clock.now_ms += 2.0

    assert timer.once(op, 5) == pytest.approx(0.010)
    assert timer.repeats_for(op) == max(1, round(ROUND_S / 0.002))
    calls.clear()
    assert timer.rounds(op, repeats=3) == [pytest.approx(0.002)] * ROUNDS and len(calls) == 3 * ROUNDS
    assert probe_rank.MAX_REPEATS >= 1


def test_a_gemm_figures_shapes_share_one_round(monkeypatch):
    timer = Timer(torch.device("cpu"))
    asked = []
    real = Timer.rounds

    def rounds(self, op, *, repeats=None, round_s=ROUND_S):
        asked.append(round_s)
        return real(self, op, repeats=repeats, round_s=round_s)

    monkeypatch.setattr(Timer, "rounds", rounds)
    gemm_rounds(timer, PLAN, device=torch.device("cpu"), precision="fp32", micro_batch=1)
    assert asked == [pytest.approx(ROUND_S / len(PLAN["gemm_shapes"]))] * len(PLAN["gemm_shapes"])
    asked.clear()
    attention_rounds(timer, {**PLAN, "eager_attention": True}, device=torch.device("cpu"), precision="fp32",
                     micro_batch=1)
    assert asked == [ROUND_S]  # one operation: a round of its own


def test_the_probe_runs_on_a_frozen_heap_and_thaws_it(monkeypatch):
    import gc

    seen = []
    monkeypatch.setattr(probe_rank, "probe_all",
                        lambda plan, *, begin: seen.append((gc.get_freeze_count(), gc.isenabled(), begin)))
    before = gc.get_freeze_count()
    assert gc.isenabled()
    probe_rank.run({}, begin=1.5)
    assert seen[0][0] > before and seen[0][2] == 1.5  # everything alive before the probe is out of its collections
    assert not seen[0][1]  # and no automatic collection falls into a round
    assert gc.get_freeze_count() == 0 and gc.isenabled()  # thawed, collecting again: a trial's cycles collectable

    def fails(plan, *, begin):
        raise RuntimeError("boom")

    monkeypatch.setattr(probe_rank, "probe_all", fails)
    with pytest.raises(RuntimeError):
        probe_rank.run({})
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_wide_operations_are_timed_on_fewer_rows_and_scaled_back(monkeypatch):
    assert probe_rank.timed_share(8, row_bytes=100) == 8  # small: every row
    monkeypatch.setattr(probe_rank, "MAX_TENSOR_BYTES", 1000)
    assert probe_rank.timed_share(8, row_bytes=300) == 3 and probe_rank.timed_share(8, row_bytes=5000) == 1
    timer = Timer(torch.device("cpu"))
    seconds = gemm_rounds(timer, PLAN, device=torch.device("cpu"), precision="fp32", micro_batch=2)
    assert len(seconds) == ROUNDS and all(s > 0 for s in seconds)  # 32 tokens timed one at a time, scaled by 32
    seconds = attention_rounds(timer, {**PLAN, "eager_attention": True}, device=torch.device("cpu"),
                               precision="fp32", micro_batch=2)
    assert len(seconds) == ROUNDS and all(s > 0 for s in seconds)
