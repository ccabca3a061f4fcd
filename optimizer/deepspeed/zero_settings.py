"""The ZeRO bucket, prefetch and offload-buffer sizes dsopt sets — one rule for the ledger and the builder.

DeepSpeed's defaults are sized for billion-parameter models: a 5e8-element ``reduce_bucket_size`` is
1 GB in bf16 and ~2 GB in fp32, which dwarfs a small model (measured here: ~2.1 GB of live tensors
per rank for a 3.7 M-parameter GPT-2 at ZeRO-2 with defaults, ~0.19 GB with 1e6-element buckets).
dsopt sizes them from the model instead, with the rule Hugging Face ``transformers`` applies to
``"auto"`` values (``integrations/deepspeed.py``, ``trainer_config_finalize``):

* ``reduce_bucket_size = h²``;
* ``stage3_prefetch_bucket_size = 0.9·h²``;
* ``stage3_param_persistence_threshold = 10·h``.

dsopt also sets ``allgather_bucket_size = h²`` (it allocates nothing: ZeRO-1/2 gather in place into
the flat parameter buffer, ``runtime/utils.py: all_gather_dp_groups``) and
``stage3_max_reuse_distance = 0.9·h²`` so that the parameters kept gathered at the forward→backward
turn are bounded like the prefetch (DeepSpeed's 1e9 default keeps up to 1e9 elements gathered,
``partitioned_param_coordinator.py``). The DeepSpeed-JSON builder emits exactly these values and the
ledger counts exactly these buffers. Pure: no torch, no deepspeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimizer.deepspeed.zero3_gather import GatherSettings
from optimizer.study.knobs import ZeroStage
from optimizer.study.specs import TransformerModel

DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000
"""``sub_group_size`` default (``runtime/zero/config.py``): the ZeRO-3 step works on sub-groups this large."""
DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000
"""``stage3_max_live_parameters`` default; it only caps prefetch (audit of ``partitioned_param_coordinator.py``)."""
DEEPSPEED_OPTIMIZER_SWAP_BUFFERS = 4
"""``offload_optimizer.buffer_count`` default (``runtime/zero/offload_config.py``)."""
DEEPSPEED_PARAM_SWAP_BUFFERS = 5
"""``offload_param.buffer_count`` default."""
DEEPSPEED_PARAM_SWAP_BUFFER_ELEMENTS = 100_000_000
"""``offload_param.buffer_size`` default (elements)."""
DEEPSPEED_PARAM_MAX_IN_CPU = 1_000_000_000
"""``offload_param.max_in_cpu`` default (elements): partitions up to this size stay in pinned host RAM."""
BUCKET_ALIGNMENT = 4
"""Buckets are rounded up to a multiple of this (ZeRO-1/2 assert a multiple of the NCCL alignment factor)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroSettings:
    """The ``zero_optimization`` sizes for one model and stage (elements, not bytes)."""

    reduce_bucket_elements: int
    """``reduce_bucket_size``."""
    allgather_bucket_elements: int
    """``allgather_bucket_size`` (stages 1–2)."""
    overlap_comm: bool
    """``overlap_comm``: two ZeRO-1/2 gradient buckets instead of one; DeepSpeed's per-stage default."""
    contiguous_gradients: bool
    """``contiguous_gradients``: gradients copied into one partition buffer (DeepSpeed default True)."""
    prefetch_bucket_elements: int
    """``stage3_prefetch_bucket_size``."""
    param_persistence_threshold: int
    """``stage3_param_persistence_threshold``: tensors this small are never partitioned."""
    max_reuse_distance: int
    """``stage3_max_reuse_distance``."""
    max_live_parameters: int
    """``stage3_max_live_parameters`` (DeepSpeed default)."""
    sub_group_size: int
    """``sub_group_size`` (DeepSpeed default)."""


def _aligned(elements: int) -> int:
    return -(-elements // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT


def zero_settings(*, model: TransformerModel, stage: ZeroStage) -> ZeroSettings:
    """The sizes dsopt uses for ``model`` at ``stage`` (see the module docstring for the rule)."""
    h = model.hidden_size
    bucket = _aligned(h * h)
    coordinator = gather_settings(h)
    return ZeroSettings(
        reduce_bucket_elements=bucket,
        allgather_bucket_elements=bucket,
        overlap_comm=stage is ZeroStage.PARAMETERS,
        contiguous_gradients=True,
        prefetch_bucket_elements=coordinator.prefetch_bucket,
        param_persistence_threshold=coordinator.persistence_threshold,
        max_reuse_distance=coordinator.max_reuse_distance,
        max_live_parameters=coordinator.max_live,
        sub_group_size=DEEPSPEED_SUB_GROUP_SIZE,
    )


def gather_settings(hidden_size: int) -> GatherSettings:
    """The ZeRO-3 coordinator's sizes dsopt sets for a model of width ``hidden_size`` (module doc)."""
    prefetch = int(0.9 * hidden_size * hidden_size)
    return GatherSettings(prefetch_bucket=prefetch, max_live=DEEPSPEED_MAX_LIVE_PARAMETERS,
                          max_reuse_distance=prefetch, persistence_threshold=10 * hidden_size)
