"""The parameter inventory of the study's model, taken from the model itself (:mod:`optimizer.study.inventory`).

The model — a ``transformers`` config (``model.hf_config``: ``AutoModelForCausalLM.from_config``, as trials build
it) or a ``model.entry_point`` — is built on ``FakeTensorMode`` (meta-backed tensors: shapes and dtypes, nothing
allocated; a 70B model takes seconds), exactly as trials and traces build it, and every parameter is read off
``named_parameters(remove_duplicate=False)``: tensors that appear under several names (tied embeddings) are
recorded once with their group. Cached by content in dsopt's cache folder (``inventory/`` in
:func:`launchers.trace.cache_dir.cache_dir`): per (model spec, torch and transformers versions, the source of dsopt's
code that builds it and of an entry point's module, the sequence length an entry point is built for), never per
study path, so a copied study or another study of the same model reads it; reading it imports no torch. A model
that cannot be built this way (custom code that needs real values, a missing package) gives one warning naming
the reason, and the ledger keeps the shape's layout — never a crash.

Studies given by their shape alone (the built-in GPT) keep the hand layout: it equals this inventory exactly
(tests/launchers/trace/test_inventory.py), and ``dsopt ledger`` then stays free of torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launchers.models.four_bit import is_four_bit
from launchers.models.setup_error import TrainableSetupError
from launchers.models.trainable import adapter_parameters
from launchers.trace.cache_dir import cache_dir, source_digest
from launchers.trace.json_cache import KeyedJsonStore
from optimizer.deepspeed.versions import installed_version, installed_versions
from optimizer.study.errors import UserError, error_summary
from optimizer.study.inventory import InventoryTensor, ParameterInventory, inventory_key
from optimizer.study.specs import TransformerModel
from optimizer.study.study_file import StudySpec

if TYPE_CHECKING:
    from torch import nn

INVENTORY_CODE = ("launchers.trace.inventory", "launchers.models.builtin", "launchers.models.construction",
                  "launchers.models.hf_model", "launchers.models.trainable", "launchers.models.four_bit")
"""dsopt's modules that build the model and read its parameters: their source is in the cache key."""


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
    adapters = adapter_parameters(model)
    tensors = []
    for qualified, (module_name, module_type, param) in owners.items():
        key = id(param)
        groups.setdefault(key, []).append(qualified)
        if key in first:
            continue
        first[key] = qualified
        tensors.append(InventoryTensor(name=qualified, module=module_name, module_type=module_type,
                                       shape=tuple(param.shape), dtype=str(param.dtype).removeprefix("torch."),
                                       trainable=bool(param.requires_grad), four_bit=is_four_bit(param),
                                       adapter=key in adapters))
    tied = tuple(tuple(names) for names in groups.values() if len(names) > 1)
    return ParameterInventory(tensors=tuple(tensors), tied=tied, model_class=type(model).__name__, source=source)


def _inner(model: nn.Module) -> nn.Module:
    """A transformers model wrapped by :class:`launchers.models.hf_model.HfCausalLM` (its loss head), unwrapped."""
    return getattr(model, "inner", model)


class EntryPointBroken(RuntimeError):
    """The entry point cannot be imported, or returns something other than ``(nn.Module, batch_fn)``: its
    trials would fail the same way (a UserError for the study)."""


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Every parameter a module registers goes to the meta device; the rest of the code runs as it is (its data
    set-up, its buffers). Like ``accelerate.init_empty_weights(include_buffers=False)``, but a parameter already
    on the meta device is kept as the same object, so ``head.weight = embed.weight`` stays one shared tensor
    (accelerate re-wraps it, and the tie would be counted twice)."""
    from torch import nn

    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _entry_model(returned: Any, name: str) -> nn.Module:
    """The model of an entry point's ``(model, batch_fn)``; EntryPointBroken for any other return."""
    from torch import nn

    if not isinstance(returned, tuple) or len(returned) != 2:
        raise EntryPointBroken(f"{name} returned {type(returned).__name__}; an entry point returns "
                               "(model, batch_fn)")
    if not isinstance(returned[0], nn.Module):
        raise EntryPointBroken(f"{name} returned a {type(returned[0]).__name__} as its model, not a torch.nn.Module")
    return returned[0]


def _build_entry_point(model_spec: dict[str, Any], *, sequence_length: int) -> tuple[nn.Module, str]:
    """The entry point's model with no parameter memory: its code run as it is with every parameter on the meta
    device (:func:`meta_parameters`), or — when that fails (a ``.to(device)`` of meta tensors, say) — on fake
    tensors. What it prints goes to stderr (stdout may carry ``--json``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from launchers.models.builtin import load_entry_point

    name = model_spec["entry_point"]
    try:
        function = load_entry_point(name)
    except (ImportError, AttributeError, ValueError) as err:
        raise EntryPointBroken(f"cannot load {name}: {type(err).__name__}: {err}") from None
    from launchers.models.fake_kernels import copies_keep_their_fake_mode, import_before_faking
    from launchers.models.trainable import apply_trainable

    args = (model_spec, sequence_length, 0, "none")
    import_before_faking(model_spec)
    with contextlib.redirect_stdout(sys.stderr):
        try:
            with meta_parameters():  # the adapters too: PEFT registers them, and they go to the meta device
                model = apply_trainable(_entry_model(function(*args), name), model_spec)
            how = f"meta-parameter build of entry point {name}"
        except (EntryPointBroken, TrainableSetupError):
            raise
        except Exception:
            with FakeTensorMode(), copies_keep_their_fake_mode():
                model = apply_trainable(_entry_model(function(*args), name), model_spec)
            how = f"fake-tensor build of entry point {name}"
    return model, how


def take_inventory(model_spec: dict[str, Any], *, sequence_length: int) -> ParameterInventory:
    """Build the model of ``model_spec`` (:func:`launchers.trial.run.model_dict`) without parameter memory and read
    its parameters; :class:`InventoryFailed` when it cannot be built that way."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from launchers.models.builtin import build_model
    from launchers.models.fake_kernels import copies_keep_their_fake_mode, import_before_faking
    from launchers.models.trainable import apply_trainable

    versions = installed_versions()
    import_before_faking(model_spec)
    try:
        if model_spec.get("entry_point"):
            model, how = _build_entry_point(model_spec, sequence_length=sequence_length)
        else:
            eager = {**model_spec, "attention": "eager"}  # the same parameters; every family has an eager kernel
            with FakeTensorMode(), copies_keep_their_fake_mode():  # what trains, as the ranks apply it, in one mode
                model = apply_trainable(build_model(eager, checkpointing="none", dtype=torch.float32), model_spec)
            how = (f"fake-tensor build: transformers {versions.get('transformers')} AutoModelForCausalLM.from_config"
                   if model_spec.get("hf_config") else "fake-tensor build of dsopt's GPT")
    except (EntryPointBroken, TrainableSetupError):  # the study's mistake: a UserError in with_inventory
        raise
    except Exception as err:  # any failure of the build is reported and the ledger keeps the layout
        raise InventoryFailed(f"{type(err).__name__}: {error_summary(err)}") from None
    adapted = [part for part, on in (("bitsandbytes 4-bit layers", model_spec.get("quantization")),
                                     ("training.frozen", model_spec.get("frozen")),
                                     ("peft.get_peft_model", model_spec.get("peft"))) if on]
    how += "".join(f" + {part}" for part in adapted)
    if not model_spec.get("entry_point"):  # dsopt's loss wrapper around a transformers model
        model = _inner(model)
    if not any(True for _ in model.parameters()):
        raise InventoryFailed("the model has no parameters")
    return inventory_of(model, source=f"{how}; torch {versions['torch']}")


class InventoryCache:
    """Parameter inventories, one file per key in ``folder`` (:class:`launchers.trace.json_cache.KeyedJsonStore`; None:
    kept in this instance only); :meth:`shared` is dsopt's cache folder."""

    def __init__(self, folder: Path | None) -> None:
        self.store = KeyedJsonStore(folder)

    @classmethod
    def shared(cls) -> InventoryCache:
        """The cache in dsopt's cache folder: ``cache_dir()/inventory``."""
        return cls(cache_dir() / "inventory")

    def get(self, key: str) -> ParameterInventory | None:
        entry = self.store.get(key)
        if entry is None:
            return None
        try:
            return ParameterInventory.from_json(entry)
        except (ValueError, KeyError, TypeError, AttributeError):  # an older format: take it again
            return None

    def put(self, key: str, inventory: ParameterInventory) -> None:
        self.store.put(key, inventory.to_json())


@contextlib.contextmanager
def importable_from(folder: Path | str | None) -> Iterator[None]:
    """``folder`` first on ``sys.path`` for the block (None: as it is): an entry point's module sits beside the
    study, and trials put that folder on their PYTHONPATH (:func:`launchers.trial.run.rank_plan`)."""
    if folder is None:
        yield
        return
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))


def with_inventory(study: StudySpec, *, warn: Callable[[str], None] | None = None) -> StudySpec:
    """The study with its model's parameter inventory filled (cached), for ``hf_config`` and ``entry_point``
    models; others come back as they are. A ``transformers`` config the library cannot build is a UserError
    naming the study and the reason (its trials would fail the same way); an entry point that cannot be built
    without memory is reported through ``warn`` (default: one stderr line) and keeps the shape's layout."""
    from launchers.trial.run import model_dict

    model = study.model
    if not isinstance(model, TransformerModel) or not model.counted_from_code:
        return study
    spec = model_dict(model)
    installed = installed_versions()  # importlib.metadata: a cached inventory is read without importing torch
    versions = {name: installed.get(name) for name in ("torch", "transformers")}
    if model.peft is not None:
        versions["peft"] = installed_version("peft")
    versions["dsopt_inventory_code"] = source_digest(INVENTORY_CODE)
    folder = study.path.parent.resolve()
    if model.entry_point:  # edited code: taken again
        versions["entry_point_source"] = source_digest([model.entry_point.partition(":")[0]], folder=folder)
    key = inventory_key(spec, versions=versions,
                        sequence_length=study.training.sequence_length if model.entry_point else None)
    cache = InventoryCache.shared()
    inventory = cache.get(key)
    if inventory is None:
        try:
            with importable_from(folder):
                inventory = take_inventory(spec, sequence_length=study.training.sequence_length)
        except EntryPointBroken as err:
            raise UserError(source=str(study.path), key="model.entry_point", why=str(err)) from None
        except TrainableSetupError as err:  # a glob or target that matches nothing, peft missing
            raise UserError(source=str(study.path), key=err.key, why=err.why) from None
        except InventoryFailed as err:
            if model.hf_config and not model.entry_point:  # trials build exactly this: they would fail too
                model_type = spec["hf_config"].get("model_type")
                raise UserError(source=str(study.path), key="model.hf_config", why=f"transformers cannot build "
                                f"this {model_type} model from its config: {err}") from None
            say = warn or (lambda line: print(line, file=sys.stderr))
            say(f"warning: {study.path}: model: cannot build the model on fake tensors to read its parameters "
                f"({err}); the ledger counts parameters from the shape's layout")
            return study
        cache.put(key, inventory)
    return dataclasses.replace(study, model=dataclasses.replace(model, inventory=inventory))


def adapted_inventory(study: StudySpec) -> StudySpec:
    """The study with its inventory taken where part of its model does not train (``model.peft``,
    ``training.frozen``): which tensors train is read off the built model, and nothing else says it. A full
    fine-tune comes back as it is (the benchmarks that replay recorded grids keep the figures they were recorded
    with; the CLI takes every study's inventory, :func:`optimizer.cli.common`)."""
    model = study.model
    return with_inventory(study) if isinstance(model, TransformerModel) and model.adapted else study
