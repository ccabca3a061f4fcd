"""Validate a DeepSpeed config with DeepSpeed's own parser (``deepspeed.runtime.config.DeepSpeedConfig``).

Not part of the pure core: it imports deepspeed, lazily. Outside an initialised process group the
parser assumes one rank, so the world-size relation ``train_batch_size = micro × accumulation × ranks``
is checked here and the parser sees the per-rank batch fields only.
"""

from __future__ import annotations

import copy
import logging
from typing import Any


class InvalidDeepSpeedConfig(ValueError):
    """DeepSpeed's parser (or the batch arithmetic) rejected the config."""


def validate_with_deepspeed(config: dict[str, Any], *, world_size: int) -> None:
    """Raise :class:`InvalidDeepSpeedConfig` unless DeepSpeed accepts ``config`` for ``world_size`` ranks."""
    micro = config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps")
    total = config.get("train_batch_size")
    if None not in (micro, accumulation, total) and total != micro * accumulation * world_size:
        raise InvalidDeepSpeedConfig(
            f"train_batch_size {total} != micro {micro} x accumulation {accumulation} x {world_size} ranks")
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.utils import logger as ds_logger
    except ImportError as err:  # pragma: no cover - deepspeed is a dependency
        raise InvalidDeepSpeedConfig(f"deepspeed is not installed: {err}") from None
    per_rank = copy.deepcopy(config)
    per_rank.pop("train_batch_size", None)
    level = ds_logger.level
    ds_logger.setLevel(logging.WARNING)
    try:
        DeepSpeedConfig(per_rank)
    except Exception as err:  # DeepSpeed raises ValueError, AssertionError, pydantic errors...
        raise InvalidDeepSpeedConfig(f"DeepSpeed rejects the config: {type(err).__name__}: {err}") from None
    finally:
        ds_logger.setLevel(level)
