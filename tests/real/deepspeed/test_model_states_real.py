"""The ledger's model-state items against what real DeepSpeed allocates on 2 CPU ranks.

One ``torchrun`` launch (``DS_ACCELERATOR=cpu``, gloo) trains one step per case and records the
bytes of DeepSpeed's own tensors: the flat low-precision parameters, the FP32 master partition, the
Adam states, and at ZeRO-3 the gradient partition, the bucket and the persistent parameters. Each
must equal the ledger's item exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from two_ranks import TINY_MODEL, TWO_CPU_RANKS, run_two_ranks

from optimizer.deepspeed.config import build_ds_config
from optimizer.ledger.core import Phase, compute_ledger
from optimizer.ledger.transformer import parameter_count
from optimizer.study.knobs import Candidate, NoCheckpointing, OffloadDevice, Precision, ZeroStage
from optimizer.study.specs import TrainingSpec

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
MODEL = TINY_MODEL
HARDWARE = TWO_CPU_RANKS
TRAINING = TrainingSpec(global_batch_size=4, micro_batch_size=2, sequence_length=32)
CASES = [
    (stage, precision, offload)
    for stage in (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS, ZeroStage.PARAMETERS)
    for precision in (Precision.FP32, Precision.BF16)
    for offload in (OffloadDevice.NONE,)
] + [(ZeroStage.OPTIMIZER, Precision.BF16, OffloadDevice.CPU)]


def _name(stage, precision, offload) -> str:
    return f"z{int(stage)}-{precision}-{offload}"


def _config(stage: ZeroStage, precision: Precision, offload: OffloadDevice) -> dict:
    return build_ds_config(candidate=_candidate(stage, precision, offload), model=MODEL, hardware=HARDWARE,
                           training=TRAINING)


def _candidate(stage: ZeroStage, precision: Precision, offload: OffloadDevice) -> Candidate:
    return Candidate(zero_stage=stage, offload_optimizer=offload, offload_param=OffloadDevice.NONE,
                     precision=precision, checkpointing=NoCheckpointing(), micro_batch_size=TRAINING.micro_batch_size)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, dict[str, int]]:
    work = tmp_path_factory.mktemp("ds_model_states")
    cases = [{"name": _name(*c), "config": _config(*c), "seq": TRAINING.sequence_length,
              "model": {"layers": MODEL.layers, "hidden": MODEL.hidden_size, "heads": MODEL.heads,
                        "ffn": MODEL.ffn_size, "vocab": MODEL.vocab_size, "positions": MODEL.max_positions}}
             for c in CASES]
    (work / "cases.json").write_text(json.dumps(cases))
    run_two_ranks(HERE / "probe_model_states.py", str(work / "cases.json"), str(work))
    out: dict[str, dict[str, int]] = {}
    for case in cases:
        ranks = [json.loads((work / f"{case['name']}.rank{r}.json").read_text()) for r in range(2)]
        out[case["name"]] = {key: max(r[key] for r in ranks) for key in ranks[0]}
    return out


def _ledger_item(led, prefix: str):
    """The training-time item named ``prefix…`` (the init phase holds some of the same tensors as it builds them)."""
    matches = [i for i in led.items if i.name.startswith(prefix) and i.phase is not Phase.INIT]
    assert len(matches) == 1, [i.name for i in led.items]
    return matches[0]


@pytest.mark.parametrize("case", CASES, ids=[_name(*c) for c in CASES])
def test_ledger_model_states_equal_deepspeeds_tensors(measured, case):
    stage, precision, offload = case
    real = measured[_name(*case)]
    assert real["psi"] == parameter_count(MODEL)
    led = compute_ledger(candidate=_candidate(*case), model=MODEL, hardware=HARDWARE, training=TRAINING)
    assert _ledger_item(led, "fp32 master partition").bytes == real["master"]
    assert _ledger_item(led, "Adam exp_avg").bytes == real["adam"]
    if stage is ZeroStage.PARAMETERS:
        assert _ledger_item(led, f"{precision} parameter partition").bytes == real["params"]
        assert _ledger_item(led, f"{precision} gradient partition").bytes == real["grad_partition"]
        assert _ledger_item(led, "gradient bucket").bytes == real["bucket"]
        assert _ledger_item(led, "persistent parameters").bytes == real["persistent"]
    else:
        assert _ledger_item(led, f"{precision} parameters (flat, full)").bytes == real["params"]
        assert real["master_is_a_copy"] == 1  # even in fp32 training: stage_1_and_2.py:560 clones
        if offload is OffloadDevice.CPU:
            assert _ledger_item(led, "fp32 gradient partition (pinned)").bytes == real["host_fp32_grads"]
