"""Run a function on a module as soon as it is imported, without importing it first (a one-shot import hook)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` once the top-level module ``name`` has been executed (one shot)."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original, then = spec.loader.exec_module, self.then

        def exec_module(module: ModuleType) -> None:
            original(module)
            then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
