"""The seed document's tables, reproduced exactly (GB = 10^9 bytes).

Reference numbers: the seed document, Q130 (docs/ledger.md "Seed mode"): plain DP 26; ZeRO-1 22; ZeRO-2 20; ZeRO-3 18;
checkpointing 21; ZeRO-1 + CPU optimizer offload 18 (4 GB per rank on the host);
ZeRO-2 + checkpointing 15. Itemised: params / grads / Adam / activations / buffers.
"""

from __future__ import annotations

import pytest

from optimizer.ledger.core import compute_ledger
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

GB = 10**9

SEED_TABLE = [
    # knobs, (params, grads, optimizer, activations, buffers) per GPU in GB, total
    ({}, (4, 4, 8, 8, 2), 26),
    ({"zero_stage": 1}, (4, 4, 4, 8, 2), 22),
    ({"zero_stage": 2}, (4, 2, 4, 8, 2), 20),
    ({"zero_stage": 3}, (2, 2, 4, 8, 2), 18),
    ({"checkpointing": "full"}, (4, 4, 8, 3, 2), 21),
    ({"zero_stage": 1, "offload_optimizer": "cpu"}, (4, 4, 0, 8, 2), 18),
    ({"zero_stage": 2, "checkpointing": "full"}, (4, 2, 4, 3, 2), 15),
]


@pytest.fixture
def seed(seed_study_path):
    return load_study(seed_study_path)


def _ledger(study, knobs):
    candidate = with_knobs(baseline_candidate(study.training), knobs)
    return compute_ledger(candidate=candidate, model=study.model, hardware=study.hardware, training=study.training)


@pytest.mark.parametrize(("knobs", "items", "total"), SEED_TABLE)
def test_seed_table_exact(seed, knobs, items, total):
    per_gpu = _ledger(seed, knobs).per_gpu()
    params, grads, optimizer, activations, buffers = items
    assert per_gpu["params"] == params * GB
    assert per_gpu["grads"] == grads * GB
    assert per_gpu["optimizer"] == optimizer * GB
    assert per_gpu["master_weights"] == 0  # the seed counts no FP32 master copy
    assert per_gpu["activations"] == activations * GB
    assert per_gpu["buffers"] == buffers * GB
    assert per_gpu["total"] == total * GB


def test_offload_share_goes_to_host(seed):
    ledger = _ledger(seed, {"zero_stage": 1, "offload_optimizer": "cpu"})
    # Each rank moves its 4 GB share of the Adam states; the node holds both ranks' shares.
    assert ledger.host_bytes == 2 * 4 * GB
    assert ledger.fits_host is True


def test_plain_data_parallel_does_not_fit_nominal_24gb(seed):
    assert not _ledger(seed, {}).fits
    assert _ledger(seed, {"zero_stage": 1}).fits


def test_bf16_follows_real_mixed_precision_not_the_seeds_amp_arithmetic(seed):
    # The seed's "22 GB with AMP" halves activations only; real mixed precision keeps 16-bit
    # params and grads plus FP32 master weights and Adam states: 2+2+4+8 = 16 bytes/param.
    per_gpu = _ledger(seed, {"precision": "bf16"}).per_gpu()
    assert per_gpu["params"] + per_gpu["grads"] + per_gpu["optimizer"] + per_gpu["master_weights"] == 16 * GB
    assert per_gpu["activations"] == 4 * GB
    assert per_gpu["total"] == 22 * GB


def test_activations_scale_with_micro_batch(seed):
    assert _ledger(seed, {"micro_batch_size": 8}).per_gpu()["activations"] == 16 * GB
    assert _ledger(seed, {"micro_batch_size": 2}).per_gpu()["activations"] == 4 * GB
