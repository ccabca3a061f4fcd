"""dsopt's cache folder (launchers/trace/cache_dir.py) and its one-file-per-key store (launchers/trace/json_cache.py):
where it is, that workers writing at once lose nothing, that an unreadable entry is missing, that a copied study reads
the traces and inventory its original made, and that reading them imports neither torch nor transformers."""

from __future__ import annotations

import multiprocessing
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launchers.trace.cache_dir import cache_dir, source_digest
from launchers.trace.json_cache import KeyedJsonStore
from optimizer.study.knobs import with_knobs
from optimizer.study.specs import baseline_candidate
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]


def test_the_folder_is_dsopts_variable_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("DSOPT_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "dsopt"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # invalid under the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "dsopt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == tmp_path / "home" / ".cache" / "dsopt"


def test_the_tests_never_write_the_users_cache():
    assert Path(cache_dir()).resolve() != (Path.home() / ".cache" / "dsopt").resolve()  # tests/conftest.py


def test_each_key_is_one_file_and_an_unreadable_one_is_missing(tmp_path):
    store = KeyedJsonStore(tmp_path)
    store.put("a", {"x": 1})
    store.put("b", [1, 2])
    assert KeyedJsonStore(tmp_path).get("a") == {"x": 1} and "b" in KeyedJsonStore(tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2 and not list(tmp_path.glob("*.tmp"))
    store.path_for("a").write_text('{"key": "a", "entry": ')  # cut short
    store.path_for("b").write_text('{"key": "c", "entry": [1, 2]}')  # another key's entry (a digest clash)
    fresh = KeyedJsonStore(tmp_path)
    assert fresh.get("a") is None and "b" not in fresh and fresh.get("never") is None
    fresh.put("a", 3)
    assert KeyedJsonStore(tmp_path).get("a") == 3
    memory = KeyedJsonStore(None)
    memory.put("a", 1)
    assert memory.get("a") == 1 and memory.path_for("a") is None


def _writer(folder: str, worker: int) -> None:
    store = KeyedJsonStore(Path(folder))
    for i in range(40):
        store.put(f"w{worker}-{i}", {"worker": worker, "i": i})
        store.put("shared", {"worker": worker, "i": i})  # every worker rewrites one key too


def test_workers_writing_at_once_lose_no_entry(tmp_path):
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(str(tmp_path), w)) for w in range(4)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(timeout=120)
        assert process.exitcode == 0
    store = KeyedJsonStore(tmp_path)
    assert all(store.get(f"w{w}-{i}") == {"worker": w, "i": i} for w in range(4) for i in range(40))
    assert store.get("shared")["i"] == 39  # some worker's last write, whole
    assert len(list(tmp_path.glob("*.json"))) == 4 * 40 + 1 and not list(tmp_path.glob("*.tmp"))


def test_an_unwritable_folder_warns_once_and_keeps_the_entry_for_the_run(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    store = KeyedJsonStore(blocked / "traces")
    store.put("a", 1)
    store.put("b", 2)
    assert store.get("a") == 1 and store.get("b") == 2
    err = capsys.readouterr().err
    assert err.count("cannot write the cache folder") == 1 and "DSOPT_CACHE_DIR" in err


def test_the_source_digest_follows_the_code(tmp_path):
    (tmp_path / "some_module.py").write_text("X = 1\n")
    before = source_digest(["some_module"], folder=tmp_path)
    assert before is not None and source_digest(["some_module"], folder=tmp_path) == before
    (tmp_path / "some_module.py").write_text("X = 2\n")
    assert source_digest(["some_module"], folder=tmp_path) not in (None, before)
    assert source_digest(["no_such_module_anywhere"], folder=tmp_path) is None
    assert str(tmp_path) not in sys.path


def _copy(name: str, folder: Path) -> Path:
    folder.mkdir(parents=True)
    for path in (ROOT / "studies").glob(f"{name}*"):
        if path.is_file():
            shutil.copy(path, folder / path.name)
    return folder / f"{name}.yaml"


def test_a_copied_study_reads_the_traces_and_inventory_its_original_made(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import launchers.trace.inventory as inventory_module
    import launchers.trace.tracer as trace_module
    from launchers.trace.inventory import with_inventory
    from launchers.trace.study_traces import with_traced_activations

    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path / "cache"))
    original = load_study(_copy("llama-tiny-cpu", tmp_path / "here"))
    candidate = with_knobs(baseline_candidate(original.training), {"checkpointing": "full", "precision": "bf16"})
    said: list[str] = []
    first = with_traced_activations(with_inventory(original), candidates=[candidate], warn=said.append)
    assert len(said) == 1 and "tracing" in said[0]

    def no_build(*args, **kwargs):
        raise AssertionError("built again although a copy of the study made it")

    monkeypatch.setattr(inventory_module, "take_inventory", no_build)
    monkeypatch.setattr(trace_module, "trace", no_build)
    moved = load_study(_copy("llama-tiny-cpu", tmp_path / "elsewhere" / "deeper"))
    again = with_traced_activations(with_inventory(moved), candidates=[candidate], warn=said.append)
    assert len(said) == 1
    assert again.model.inventory == first.model.inventory
    assert again.model.traced_activations == first.model.traced_activations
    assert not (tmp_path / "here" / "llama-tiny-cpu").exists()  # nothing written beside either study


def test_a_warm_cache_is_read_without_torch_or_transformers(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from launchers.trace.inventory import with_inventory
    from launchers.trace.study_traces import with_traced_activations

    monkeypatch.setenv("DSOPT_CACHE_DIR", str(tmp_path / "cache"))
    path = _copy("llama-tiny-cpu", tmp_path / "study")
    study = load_study(path)
    candidate = with_knobs(baseline_candidate(study.training), {"precision": "bf16"})
    warm = with_traced_activations(with_inventory(study), candidates=[candidate])
    code = (
        "import sys\n"
        "from launchers.trace.inventory import with_inventory\n"
        "from launchers.trace.study_traces import with_traced_activations\n"
        "from optimizer.study.knobs import with_knobs\n"
        "from optimizer.study.specs import baseline_candidate\n"
        "from optimizer.study.study_file import load_study\n"
        f"study = load_study({str(path)!r})\n"
        "candidate = with_knobs(baseline_candidate(study.training), {'precision': 'bf16'})\n"
        "study = with_traced_activations(with_inventory(study), candidates=[candidate], warn=sys.exit)\n"
        "print(study.model.inventory.digest)\n"
        "print(repr(study.model.traced_activations[0].points))\n"
        "sys.exit(sorted({'torch', 'transformers'} & set(sys.modules)) or 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:] or proc.stdout
    assert proc.stdout.splitlines() == [warm.model.inventory.digest, repr(warm.model.traced_activations[0].points)]
