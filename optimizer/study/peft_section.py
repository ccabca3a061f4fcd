"""What trains: the study file's ``model.peft`` (a PEFT LoRA setup) and ``training.frozen`` (parameter-name globs that
do not train), checked before any work (pure: peft itself is imported only where the model is built,
:mod:`launchers.models.trainable`).

``model.peft`` is a mapping with ``peft.LoraConfig``'s own field names (peft 0.21, ``tuners/lora/config.py``), or
the path of a PEFT ``adapter_config.json`` (relative to the study file). dsopt plans the fields below; a mapping
with any other key is refused naming it. A saved ``adapter_config.json`` carries every field of its release:
those dsopt does not plan are accepted where they hold their default (``None``, ``False``, ``{}``, ``[]``) —
bookkeeping such as ``base_model_name_or_path``, ``revision`` and ``inference_mode`` (a saved adapter is marked
for inference; dsopt plans its training) is ignored — and refused, naming the file and the field, where they
would change what trains (``loftq_config``, ``layer_replication``, ``target_parameters``, …).

The setup is kept as canonical JSON (sorted keys) on :class:`~optimizer.study.specs.TransformerModel`: it is part of
what the ranks build, so every cache key (traces, inventories, the FP32 reference) carries it.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from optimizer.study.errors import UserError

PLANNED_FIELDS = ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules",
                  "modules_to_save", "bias", "fan_in_fan_out", "use_dora", "use_rslora", "init_lora_weights",
                  "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "lora_bias")
"""``LoraConfig`` fields dsopt plans (each checked below)."""

BOOKKEEPING_FIELDS = ("base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version")
"""Fields of a saved ``adapter_config.json`` that say where it came from, not what trains: ignored."""

INERT_DEFAULTS = {"megatron_core": "megatron.core", "qalora_group_size": 16}
"""Unplanned fields whose default is not empty but which act only beside another field that is (``megatron_core``
with ``megatron_config``, ``qalora_group_size`` with ``use_qalora``): accepted at these values in a saved config."""

BIAS_CHOICES = ("none", "all", "lora_only")
"""``LoraConfig.bias``: which biases train beside the adapters (peft ``tuners/tuners_utils.py``
``_mark_only_adapters_as_trainable``)."""

INIT_CHOICES = (True, False, "gaussian")
"""``init_lora_weights`` values that need no data or decomposition of the base weights (PiSSA, EVA, LoftQ,
CorDA, OLoRA need real weights; dsopt builds random ones)."""


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive whole number, got {value!r}")
    return value


def _number(value: Any, what: str) -> float:
    if isinstance(value, str):  # YAML 1.1 reads 1e-1 as a string
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{what} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number, got {value!r}")
    return float(value)


def _names(value: Any, what: str, *, all_linear: bool = False) -> str | list[str]:
    """A module-name list, a regular expression string (PEFT's full-match rule), or ``all-linear``."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{what} must not be empty")
        if value == "all-linear" and not all_linear:
            raise ValueError(f"{what}: 'all-linear' is for target_modules only")
        return value
    if isinstance(value, list | tuple) and value and all(isinstance(v, str) and v for v in value):
        return sorted(set(value))
    raise ValueError(f"{what} must be a list of module names (or a regular expression string"
                     f"{', or all-linear' if all_linear else ''}), got {value!r}")


def _check_field(name: str, value: Any) -> Any:
    """The canonical value of one planned field; ValueError naming the field's rule."""
    if name == "peft_type":
        if str(value).upper() != "LORA":
            raise ValueError(f"dsopt plans LoRA adapters (peft_type: LORA), got {value!r}")
        return "LORA"
    if name == "task_type":
        if str(value).upper() != "CAUSAL_LM":
            raise ValueError(f"dsopt plans causal language models (task_type: CAUSAL_LM), got {value!r}")
        return "CAUSAL_LM"
    if name == "r":
        return _positive_int(value, "r (the adapters' rank)")
    if name == "lora_alpha":
        return _number(value, "lora_alpha")
    if name == "lora_dropout":
        p = _number(value, "lora_dropout")
        if not 0.0 <= p < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {value!r}")
        return p
    if name == "target_modules":
        return _names(value, "target_modules", all_linear=True)
    if name in ("exclude_modules", "modules_to_save", "layers_pattern"):
        return _names(value, name)
    if name == "bias":
        if value not in BIAS_CHOICES:
            raise ValueError(f"bias must be one of {', '.join(BIAS_CHOICES)}, got {value!r}")
        return value
    if name in ("fan_in_fan_out", "use_dora", "use_rslora", "lora_bias"):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if name == "init_lora_weights":
        if not any(value is c or (isinstance(c, str) and value == c) for c in INIT_CHOICES):
            raise ValueError("init_lora_weights must be true, false or gaussian (the others initialise from the "
                             f"real base weights, which a plan does not have), got {value!r}")
        return value
    if name == "layers_to_transform":
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(v, int) and not isinstance(v, bool)
                                                                and v >= 0 for v in value):
            raise ValueError(f"layers_to_transform must be a layer index or a list of them, got {value!r}")
        return sorted(set(value))
    if name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"{name} must map module-name patterns to numbers, got {value!r}")
        rule = _positive_int if name == "rank_pattern" else _number
        return {k: rule(v, f"{name}.{k}") for k, v in sorted(value.items())}
    raise AssertionError(name)


def _is_default(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, Mapping | list | tuple) and not value)


def lora_fields(raw: Mapping[str, Any], *, source: str, prefix: str, saved: bool) -> dict[str, Any]:
    """The checked LoRA fields of ``raw`` (see the module docstring); ``saved``: read from an adapter_config.json,
    whose unplanned fields are accepted at their defaults. Errors name ``source`` and ``prefix`` + the field."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key)
        if name in PLANNED_FIELDS:
            if value is None:
                continue
            try:
                out[name] = _check_field(name, value)
            except ValueError as err:
                raise UserError(source=source, key=prefix + name, why=str(err)) from None
        elif saved and (name in BOOKKEEPING_FIELDS or _is_default(value) or INERT_DEFAULTS.get(name) == value):
            continue
        elif saved:
            raise UserError(source=source, key=prefix + name, why="dsopt cannot plan this LoraConfig field at "
                            f"{value!r} (it plans {', '.join(PLANNED_FIELDS)})")
        else:
            raise UserError(source=source, key=prefix + name, why="unknown LoraConfig field; dsopt plans "
                            + ", ".join(PLANNED_FIELDS))
    out.setdefault("peft_type", "LORA")
    if "target_modules" not in out:
        raise UserError(source=source, key=prefix + "target_modules", why="required: the modules that get adapters "
                        "(a list of names such as [q_proj, v_proj], a regular expression, or all-linear)")
    if out.get("use_dora") and out.get("lora_bias"):
        raise UserError(source=source, key=prefix + "lora_bias", why="PEFT refuses lora_bias with use_dora")
    return out


def parse_peft(value: Any, *, source: str, key: str, study_dir: Path) -> str:
    """``model.peft`` as canonical JSON: an inline mapping, or the path of an ``adapter_config.json``."""
    if isinstance(value, Mapping):
        fields = lora_fields(value, source=source, prefix=key + ".", saved=False)
    elif isinstance(value, str):
        path = Path(value) if Path(value).is_absolute() else study_dir / value
        if not path.is_file():
            raise UserError(source=source, key=key, why=f"no such file: {path} (a PEFT adapter_config.json)")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise UserError(source=str(path), key="", why=f"not a JSON adapter config: {err}") from None
        if not isinstance(data, dict):
            raise UserError(source=str(path), key="", why="expected a JSON object (a PEFT adapter_config.json)")
        fields = lora_fields(data, source=str(path), prefix="", saved=True)
    else:
        raise UserError(source=source, key=key, why="expected a mapping of LoraConfig fields (r, lora_alpha, "
                        "target_modules, ...) or the path of a PEFT adapter_config.json")
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def parse_frozen(value: Any) -> tuple[str, ...]:
    """``training.frozen``: glob patterns (``fnmatch``) of parameter names that do not train."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError("expected a list of glob patterns of parameter names, e.g. [model.embed_tokens.*, "
                         "'model.layers.[0-9].*']")
    return tuple(dict.fromkeys(v.strip() for v in value))


def frozen_by(patterns: tuple[str, ...], name: str) -> bool:
    """Whether the parameter ``name`` matches one of ``patterns`` (``fnmatch.fnmatchcase``)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def unmatched_patterns(patterns: tuple[str, ...], names: list[str]) -> list[str]:
    """The patterns that match none of ``names``: a typo that would silently train everything."""
    return [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
