"""The one-shot import hook the script hook patches DeepSpeed with (launchers/process/after_import.py)."""

from __future__ import annotations

import importlib.util
import sys

from launchers.process.after_import import AfterImport


def test_a_probe_does_not_spend_the_hook_and_the_import_runs_it_once(tmp_path, monkeypatch):
    (tmp_path / "probed_pkg.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hook = AfterImport("probed_pkg", lambda module: seen.append(module.VALUE))
    monkeypatch.setattr(sys, "meta_path", [hook, *sys.meta_path])
    assert importlib.util.find_spec("probed_pkg") is not None  # is_*_available(): a look, no import
    assert seen == [] and hook in sys.meta_path
    import probed_pkg  # noqa: F401

    assert seen == [1] and hook not in sys.meta_path
    sys.modules.pop("probed_pkg")
