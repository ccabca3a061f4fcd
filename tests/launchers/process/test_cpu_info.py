"""py-cpuinfo's answer kept once per node for DeepSpeed's op loads (launchers/process/cpu_info.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launchers.process.cpu_info import FOLDER, entry_path, kept

ROOT = Path(__file__).resolve().parents[3]


def test_the_first_call_probes_and_writes_every_later_one_reads(tmp_path):
    calls = []

    def probe():
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2"], "hz_actual": [1, 0]}

    path = entry_path(tmp_path, "9.0.0")
    first = kept(probe, path)
    assert first() == {"arch": "X86_64", "flags": ["avx2"], "hz_actual": [1, 0]} and len(calls) == 1
    first()["flags"].append("mutated")  # each call gets its own copy
    assert first()["flags"] == ["avx2"] and len(calls) == 1
    assert json.loads(path.read_text())["arch"] == "X86_64"
    assert kept(probe, path)() == first() and len(calls) == 1  # another rank, another process: the file
    assert path.parent.name == FOLDER and not list(path.parent.glob(".*"))  # no part file left


def test_a_probe_that_fails_is_not_kept_and_a_bad_entry_is_probed_again(tmp_path):
    path = entry_path(tmp_path, "9.0.0")

    def broken():
        raise RuntimeError("no cpuid")

    with pytest.raises(RuntimeError):
        kept(broken, path)()  # DeepSpeed catches it and asks lscpu
    assert not path.exists()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert kept(lambda: {"arch": "ARM_8", "flags": []}, path)() == {"arch": "ARM_8", "flags": []}
    assert json.loads(path.read_text()) == {"arch": "ARM_8", "flags": []}


def test_a_folder_that_cannot_be_written_costs_only_the_probe(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert kept(lambda: {"arch": "X86_64", "flags": []}, entry_path(blocker, "9.0.0"))() == {
        "arch": "X86_64", "flags": []}


def _get_cpu_info_in_a_process(env: dict[str, str]) -> dict:
    code = ("from launchers.process.cpu_info import install; install(); "
            "from cpuinfo import get_cpu_info; import json; print(json.dumps(get_cpu_info()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_deepspeeds_import_of_py_cpuinfo_gets_the_nodes_kept_answer(tmp_path):
    """As DeepSpeed's op builder calls it (``from cpuinfo import get_cpu_info``), in fresh processes: the first
    probes the real CPU and keeps it; the next reads the entry (shown by a marker written into it)."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    first = _get_cpu_info_in_a_process(env)
    import cpuinfo

    entry = entry_path(tmp_path, cpuinfo.CPUINFO_VERSION_STRING)
    assert json.loads(entry.read_text()) == first
    assert first["arch"] == cpuinfo.get_cpu_info()["arch"]  # the real probe's answer
    entry.write_text(json.dumps({**first, "brand_raw": "marker"}))
    assert _get_cpu_info_in_a_process(env)["brand_raw"] == "marker"
    without = {k: v for k, v in env.items() if k != "TORCH_EXTENSIONS_DIR"}
    assert _get_cpu_info_in_a_process(without).get("brand_raw") != "marker"  # not a dsopt launch: untouched


def test_an_empty_answer_is_asked_again_and_never_written(tmp_path):
    answers = iter([{}, {"arch": "X86_64", "flags": []}])  # py-cpuinfo's {} when its subprocess fails, then a real one
    path = entry_path(tmp_path, "9.0.0")
    get = kept(lambda: next(answers), path)
    assert get() == {} and not path.exists()
    assert get() == {"arch": "X86_64", "flags": []} and path.exists()


def test_installing_after_cpuinfo_was_imported_patches_it_at_once(tmp_path, monkeypatch):
    import cpuinfo

    from launchers.process.cpu_info import install

    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: {"arch": "PROBED", "flags": []})  # restored after the test
    install({"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert cpuinfo.get_cpu_info()["arch"] == "PROBED"
    (entry,) = (tmp_path / FOLDER).glob("*.json")
    assert json.loads(entry.read_text())["arch"] == "PROBED"
