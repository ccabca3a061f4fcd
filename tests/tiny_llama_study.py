"""A study file of the tiny Llama (examples/tiny-llama) on 2 CPU ranks, for the tests of what trains: the model as
``hf_config``, extra keys merged into its ``model`` and ``training`` sections."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

LLAMA = json.loads((Path(__file__).parents[1] / "examples" / "tiny-llama" / "config.json").read_text())


def llama_study(tmp_path: Path, *, model_extra: dict | None = None, training_extra: dict | None = None,
                model: dict | None = None, config: dict | None = None) -> Path:
    """``tmp_path/study.yaml`` (beside ``config.json``, ``config`` or the tiny Llama's); ``model`` replaces the
    whole model section."""
    (tmp_path / "config.json").write_text(json.dumps(config or LLAMA))
    raw = {"name": "t", "model": model or {"kind": "transformer", "hf_config": "config.json", "attention": "eager",
                                           **(model_extra or {})},
           "hardware": {"accelerator": "cpu", "gpus_per_node": 2, "gpu_memory": "1 GiB"},
           "training": {"global_batch_size": 8, "micro_batch_size": 2, "sequence_length": 32,
                        **(training_extra or {})},
           "search_space": {"knobs": {"zero_stage": [0, 3]}}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path
