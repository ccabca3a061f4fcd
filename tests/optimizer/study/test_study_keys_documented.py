"""docs/study-file.md lists every key the study-file reader accepts, and nothing it does not (issue 23).

The reader's keys are taken from the reader itself: every :class:`optimizer.study.fields.Section` records each key
it is asked for (the optional ones too, whether the file has them or not), and refuses the rest at ``finish()``.
Loading study files that take every branch of the reader (a seed-mode model, a model given by its shape, a
``transformers`` config, a hardware profile given by name and by its figures, every optional section) and
collecting what the sections allowed gives the accepted keys; the page's key tables give the documented ones.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from optimizer.study import fields
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "study-file.md"
KEY_ROW = re.compile(r"^\|\s*`([a-z_][a-z0-9_.]*)`\s*\|", re.MULTILINE)

PROFILE_FIGURES = {"accelerator": "cuda", "gpus_per_node": 1, "gpu_memory": "24 GiB", "device_reserve": "1 GiB",
                   "allocator_overhead": 0.1}


def _reader_keys(monkeypatch, tmp_path) -> set[str]:
    allowed: set[str] = set()
    original = fields.Section.finish

    def finish(self) -> None:
        allowed.update(self.full_key(name) for name in self.seen)
        original(self)

    monkeypatch.setattr(fields.Section, "finish", finish)
    for name in ("seed-1b-2x24gb", "cpu-tiny", "llama-tiny-cpu", "llama-70b-8xh100", "cluster-cpu"):
        load_study(ROOT / "studies" / f"{name}.yaml")
    raw = yaml.safe_load((ROOT / "studies" / "cpu-tiny.yaml").read_text())
    raw["search_space"] = str(ROOT / "search_spaces" / "default.yaml")
    for hardware in _profile_variants():
        raw["hardware"] = hardware
        path = tmp_path / "variant.yaml"
        path.write_text(yaml.safe_dump(raw))
        load_study(path)
    return allowed


def _profile_variants() -> list[dict]:
    """Hardware sections that reach the profile's own figures (when the reader takes a mapping there)."""
    example = DOC.read_text().split("```yaml")
    mappings = []
    for block in example[1:]:
        data = yaml.safe_load(block.split("```", 1)[0])
        profile = (data or {}).get("hardware", {}).get("profile") if isinstance(data, dict) else None
        if isinstance(profile, dict):
            mappings.append({**PROFILE_FIGURES, **{k: v for k, v in data["hardware"].items()
                                                   if k not in ("nvme_path", "nvme_capacity")}, "profile": profile})
    return mappings


def _documented_keys() -> set[str]:
    text = DOC.read_text()
    section = text.split("## Every key", 1)
    assert len(section) == 2, "docs/study-file.md has no '## Every key' section"
    body = section[1].split("\n## ", 1)[0]
    return set(KEY_ROW.findall(body))


def test_every_key_the_reader_accepts_is_documented_and_no_other(monkeypatch, tmp_path):
    accepted = _reader_keys(monkeypatch, tmp_path)
    documented = _documented_keys()
    assert {"hardware.gpu_memory", "model.hf_config", "model.parameters", "budget.headroom",
            "slurm.setup", "trial.fidelity_tolerance", "name", "search_space"} <= accepted  # every branch taken
    assert sorted(accepted - documented) == [], "accepted by the reader but not in docs/study-file.md"
    assert sorted(documented - accepted) == [], "documented in docs/study-file.md but refused by the reader"


@pytest.mark.parametrize("key", ["hardware.gpu_memory", "hardware.device_reserve", "training.sequence_length"])
def test_each_documented_row_states_a_unit_or_type_and_a_default(key):
    text = DOC.read_text().split("## Every key", 1)[1]
    row = next(line for line in text.splitlines() if line.startswith(f"| `{key}`"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) >= 4 and all(cells[:4]), row
