"""Run a function on a module as soon as it is imported, without importing it first (a one-shot import hook)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` once the top-level module ``name`` has been executed, then leaves ``sys.meta_path``.

    A probe that only looks for the module — ``importlib.util.find_spec("deepspeed")``, as transformers' and
    accelerate's ``is_deepspeed_available`` do — also reaches :meth:`find_spec`; the spec it gets back runs ``then``
    only if it is executed, so the hook stays in place for the real import."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then
        self._looking = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name or self._looking:
            return None
        self._looking = True  # the other finders' answer, not ours again
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._looking = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            self.then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
