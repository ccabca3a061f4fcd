"""The parameter inventory of the study's model, taken from the model itself (:mod:`optimizer.inventory`).

The model — a ``transformers`` config (``model.hf_config``: ``AutoModelForCausalLM.from_config``, as trials build
it) or a ``model.entry_point`` — is built on ``FakeTensorMode`` (meta-backed tensors: shapes and dtypes, nothing
allocated; a 70B model takes seconds), exactly as trials and traces build it, and every parameter is read off
``named_parameters(remove_duplicate=False)``: tensors that appear under several names (tied embeddings) are
recorded once with their group. Cached per (model spec, torch and transformers versions) in
``studies/NAME/inventory.json``. A model that cannot be built this way (custom code that needs real values, a
missing package) gives one warning naming the reason, and the ledger keeps the shape's layout — never a crash.

Studies given by their shape alone (the built-in GPT) keep the hand layout: it equals this inventory exactly
(tests/test_inventory.py), and ``dsopt ledger`` then stays free of torch.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from launchers.json_cache import JsonFileCache
from optimizer.errors import UserError
from optimizer.inventory import InventoryTensor, ParameterInventory, inventory_key
from optimizer.specs import TransformerModel
from optimizer.study_file import StudySpec
from optimizer.versions import installed_versions


class InventoryFailed(RuntimeError):
    """The model could not be built on fake tensors; the message says why."""


def inventory_of(model: nn.Module, *, source: str) -> ParameterInventory:
    """Every parameter of a built ``model`` (module docstring): owners, classes, shapes, dtypes, tied groups."""
    owners = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            qualified = f"{module_name}.{name}" if module_name else name
            owners[qualified] = (module_name, type(module).__name__, param)
    first: dict[int, str] = {}
    groups: dict[int, list[str]] = {}
    tensors = []
    for qualified, (module_name, module_type, param) in owners.items():
        key = id(param)
        groups.setdefault(key, []).append(qualified)
        if key in first:
            continue
        first[key] = qualified
        tensors.append(InventoryTensor(name=qualified, module=module_name, module_type=module_type,
                                       shape=tuple(param.shape), dtype=str(param.dtype).removeprefix("torch.")))
    tied = tuple(tuple(names) for names in groups.values() if len(names) > 1)
    return ParameterInventory(tensors=tuple(tensors), tied=tied, model_class=type(model).__name__, source=source)


def _inner(model: nn.Module) -> nn.Module:
    """A transformers model wrapped by :class:`launchers.hf_model.HfCausalLM` (its loss head), unwrapped."""
    return getattr(model, "inner", model)


def _build_entry_point(model_spec: dict[str, Any], *, sequence_length: int) -> tuple[nn.Module, str]:
    """The entry point's model with no parameter memory: on fake tensors, or — when its code needs real values
    outside the model (a data set-up, say) — with only the parameters on the meta device (accelerate's
    ``init_empty_weights``, what transformers uses for big models), the rest of its code run as it is."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from launchers.workload import load_entry_point

    function = load_entry_point(model_spec["entry_point"])
    name = model_spec["entry_point"]
    try:
        with FakeTensorMode():
            return function(model_spec, sequence_length, 0, "none")[0], f"fake-tensor build of entry point {name}"
    except Exception as fake_error:
        try:
            from accelerate import init_empty_weights
        except ImportError:
            raise fake_error from None
        with init_empty_weights(include_buffers=False):
            model = function(model_spec, sequence_length, 0, "none")[0]
        return model, f"meta-parameter build of entry point {name} (accelerate.init_empty_weights)"


def take_inventory(model_spec: dict[str, Any], *, sequence_length: int) -> ParameterInventory:
    """Build the model of ``model_spec`` (:func:`launchers.trial.model_dict`) without parameter memory and read
    its parameters; :class:`InventoryFailed` when it cannot be built that way."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from launchers.workload import build_model

    versions = installed_versions()
    try:
        if model_spec.get("entry_point"):
            model, how = _build_entry_point(model_spec, sequence_length=sequence_length)
        else:
            eager = {**model_spec, "attention": "eager"}  # the same parameters; every family has an eager kernel
            with FakeTensorMode():
                model = _inner(build_model(eager, checkpointing="none", dtype=torch.float32))
            how = (f"fake-tensor build: transformers {versions.get('transformers')} AutoModelForCausalLM.from_config"
                   if model_spec.get("hf_config") else "fake-tensor build of dsopt's GPT")
    except Exception as err:  # any failure of the build is reported and the ledger keeps the layout
        first = (str(err).strip().splitlines() or [""])[0]
        raise InventoryFailed(f"{type(err).__name__}: {first[:300]}") from None
    if not isinstance(model, nn.Module):
        raise InventoryFailed(f"the entry point returned {type(model).__name__}, not a torch.nn.Module")
    if not any(True for _ in model.parameters()):
        raise InventoryFailed("the model has no parameters")
    return inventory_of(model, source=f"{how}; torch {versions['torch']}")


class InventoryCache(JsonFileCache):
    """``studies/NAME/inventory.json``: one entry per (model spec, library versions)."""

    def get(self, key: str) -> ParameterInventory | None:
        entry = self.data.get(key)
        if entry is None:
            return None
        try:
            return ParameterInventory.from_json(entry)
        except (ValueError, KeyError, TypeError):  # an older format: take it again
            return None

    def put(self, key: str, inventory: ParameterInventory) -> None:
        self.store(key, inventory.to_json())


def needs_inventory(model: object) -> bool:
    """Whether the study's model is built by code the shape does not describe (a transformers config or an
    entry point) and has no inventory yet."""
    return isinstance(model, TransformerModel) and model.inventory is None and bool(model.hf_config or
                                                                                     model.entry_point)


def with_inventory(study: StudySpec, *, warn: Callable[[str], None] | None = None) -> StudySpec:
    """The study with its model's parameter inventory filled (cached), for ``hf_config`` and ``entry_point``
    models; others come back as they are. A ``transformers`` config the library cannot build is a UserError
    naming the study and the reason (its trials would fail the same way); an entry point that cannot be built
    without memory is reported through ``warn`` (default: one stderr line) and keeps the shape's layout."""
    from launchers.trial import model_dict

    model = study.model
    if not needs_inventory(model):
        return study
    assert isinstance(model, TransformerModel)
    spec = model_dict(model)
    versions = {name: installed_versions().get(name) for name in ("torch", "transformers")}
    key = inventory_key(spec, versions=versions)
    cache = InventoryCache(study.output_dir / "inventory.json")
    inventory = cache.get(key)
    if inventory is None:
        folder = str(study.path.parent.resolve())  # an entry point's module sits beside the study, as in trials
        sys.path.insert(0, folder)
        try:
            inventory = take_inventory(spec, sequence_length=study.training.sequence_length)
        except InventoryFailed as err:
            if model.hf_config and not model.entry_point:  # trials build exactly this: they would fail too
                model_type = spec["hf_config"].get("model_type")
                raise UserError(source=str(study.path), key="model.hf_config", why=f"transformers cannot build "
                                f"this {model_type} model from its config: {err}") from None
            say = warn or (lambda line: print(line, file=sys.stderr))
            say(f"warning: {study.path}: model: cannot build the model on fake tensors to read its parameters "
                f"({err}); the ledger counts parameters from the shape's layout")
            return study
        finally:
            sys.path.remove(folder)
        cache.put(key, inventory)
    return dataclasses.replace(study, model=dataclasses.replace(model, inventory=inventory))
