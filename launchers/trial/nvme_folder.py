"""One NVMe swap folder per launch: ``<nvme_path>/dsopt-<launch id>``, created before the launch, removed after it.

DeepSpeed swaps parameters under ``nvme_path/zero_stage_3/<dtype>params/rank<r>``, which it removes when it
starts (``runtime/swap_tensor/partitioned_param_swapper.py:86-89``), and optimizer states under
``nvme_path/zero_stage_3/optimizer/rank<r>`` (``runtime/zero/stage3.py:840``): two launches on one node given the
study's ``nvme_path`` as it is — two workers' slots — would delete and overwrite each other's swap files (rank 0 of
both is ``rank0``). Each launch is therefore told its own sub-folder (:func:`per_launch_config`, pure), which
:func:`create_folders` makes before the launch and :func:`remove_folders` removes once it ended, however it ended
(timeout, crash, an interrupt). Only the launch's ``plan.json`` carries it: the trial's ``ds_config.json`` and
``dsopt export`` keep the user's ``nvme_path``.

A relative ``nvme_path`` is taken from the worker's current folder, where the study file's check found it
(``hardware.nvme_path`` must be an existing directory there), and the ranks are given the absolute folder.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FOLDER_PREFIX = "dsopt-"
"""A launch's folder is ``<nvme_path>/dsopt-<launch id>``."""
OFFLOAD_SECTIONS = ("offload_optimizer", "offload_param")
"""The ``zero_optimization`` sections that may carry an ``nvme_path``."""


def per_launch_config(config: dict[str, Any], *, launch_id: str, cwd: Path) -> tuple[dict[str, Any], tuple[Path, ...]]:
    """``config`` with each offload section's ``nvme_path`` replaced by ``<nvme_path>/dsopt-<launch_id>`` (absolute:
    a relative ``nvme_path`` is resolved against ``cwd``), and those folders; ``config`` itself is not changed.
    A config without an ``nvme_path`` comes back equal, with no folder."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or not any(isinstance(zero.get(s), dict) and zero[s].get("nvme_path")
                                             for s in OFFLOAD_SECTIONS):
        return config, ()
    out = copy.deepcopy(config)
    folders: list[Path] = []
    for section in OFFLOAD_SECTIONS:
        offload = out["zero_optimization"].get(section)
        if not isinstance(offload, dict) or not offload.get("nvme_path"):
            continue
        folder = (cwd / str(offload["nvme_path"])) / f"{FOLDER_PREFIX}{launch_id}"
        offload["nvme_path"] = str(folder)
        if folder not in folders:
            folders.append(folder)
    return out, tuple(folders)


def create_folders(folders: Sequence[Path]) -> None:
    """Create ``folders`` (their parent, the study's ``nvme_path``, must exist); on an error, remove those made and
    raise it (OSError)."""
    made: list[Path] = []
    try:
        for folder in folders:
            folder.mkdir(exist_ok=False)
            made.append(folder)
    except OSError:
        remove_folders(made)
        raise


def remove_folders(folders: Sequence[Path]) -> None:
    """Remove ``folders`` and everything in them (what the ranks swapped out); a folder already gone is fine."""
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
