"""DeepSpeed's Autotuner walk as its source implements it (``deepspeed/autotuning/autotuner.py``: ``tune``,
``tune_space``, ``get_min_max_micro_batch_size``, ``get_tuning_micro_batch_size_list``), for the replays of
benchmarks/search_efficiency.py: ZeRO stages in order; per stage the maximum micro-batch from its memory model
((budget − Adam model states of the stage) // forward activation memory at micro-batch 1), a probe of the minimum
micro-batch, then of ~1.05×, 1×, 0.95× the maximum, a binary search if none runs, then the top micro-batches; a
stage is skipped when its computed maximum is below the previous stage's. It tunes neither offload nor precision
nor checkpointing (the baseline's are used)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from optimizer.ledger.core import evaluate
from optimizer.ledger.transformer import activation_estimate, parameter_count
from optimizer.study.knobs import Candidate, Precision, ZeroStage, parse_knob
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import StudySpec


def autotuner_walk(spec: StudySpec, *, run: Callable[[Candidate], float], reached: Callable[[], bool]) -> None:
    """Walk ``spec``'s space as the Autotuner does (module doc): ``run(candidate)`` launches one and returns its
    tokens/s (0 when it failed or did not fit); ``reached()`` says the walk may stop."""
    base = baseline_candidate(spec.training)
    allowed = sorted(int(m) for m in dict(spec.search_space.values).get("micro_batch_size", (base.micro_batch_size,)))
    stages = sorted(int(s) for s in dict(spec.search_space.values).get("zero_stage", (base.zero_stage,)))
    psi = parameter_count(spec.model)
    ranks = spec.hardware.world_size
    budget = spec.hardware.gpu_memory_bytes
    fp16 = base.precision is not Precision.FP32
    # Forward-only activation profile at micro-batch 1, no checkpointing (the Autotuner's model-info run).
    act = activation_estimate(spec.model, checkpointing=parse_knob("checkpointing", "none"),
                              seq=spec.training.sequence_length, micro_batch=1, element_bytes=2 if fp16 else 4)
    act_bytes = max(1, act.stored_bytes)
    results: dict[int, dict[int, float]] = {}

    def launch(stage: int, mbs: int) -> float:
        candidate = replace(base, zero_stage=ZeroStage(stage), micro_batch_size=mbs)
        if evaluate(candidate=candidate, model=spec.model, hardware=spec.hardware,
                    training=spec.training).ledger is None:
            return 0.0  # an invalid candidate is refused before any launch
        value = run(candidate)
        results.setdefault(stage, {})[mbs] = value
        return value

    def listed_at_most(value: int) -> int | None:
        fitting = [m for m in allowed if m <= value]
        return max(fitting) if fitting else None

    prev_max = 0
    for stage in stages:
        params = psi * (2 if fp16 else 4)
        grads = psi * (2 if fp16 else 4)
        optim = psi * (16 if fp16 else 8)
        if stage >= 1:
            optim /= ranks
        if stage >= 2:
            grads /= ranks
        if stage >= 3:
            params /= ranks
        calc_max = int(budget - (params + grads + optim)) // act_bytes
        if calc_max < prev_max:
            continue
        if not launch(stage, allowed[0]):
            continue
        top = listed_at_most(min(calc_max, allowed[-1]))
        found = None
        for probe in (int(np.ceil(1.05 * (top or 0))), top or 0, int(0.95 * (top or 0))):
            probe = listed_at_most(probe) if probe else None
            if probe is None:
                continue
            if probe in results.get(stage, {}):
                found = probe if results[stage][probe] else None
                if found:
                    break
                continue
            if launch(stage, probe):
                found = probe
                break
        if found is None:  # binary search for the largest micro-batch that runs
            low, high = 0, allowed.index(top) if top in allowed else 0
            while low <= high:
                mid = (low + high) // 2
                value = results.get(stage, {}).get(allowed[mid])
                if value is None:
                    value = launch(stage, allowed[mid])
                if value:
                    found, low = allowed[mid], mid + 1
                else:
                    high = mid - 1
        if found is None:
            continue
        prev_max = max(prev_max, found)
        # get_tuning_micro_batch_size_list: sizes from max/2 to max (3 of them)
        for mbs in [m for m in allowed if found // 2 <= m <= found]:
            if mbs not in results.get(stage, {}):
                launch(stage, mbs)
        if reached():
            break
