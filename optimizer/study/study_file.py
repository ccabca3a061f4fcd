"""Load a study file (``studies/NAME.yaml``) into typed specs, or fail with one clear error.

A study file holds these sections::

    name: seed-1b-2x24gb          # optional; defaults to the file name
    model: {kind: seed | transformer, ...}
    hardware: {gpus_per_node: 2, gpu_memory: 24 GB, ...}
    training: {global_batch_size: 16, micro_batch_size: 4, sequence_length: 1024}
    search_space: ../search_spaces/default.yaml   # or an inline {knobs: {...}}
    trial: {timeout_s: 300, retries: 1, ...}      # optional: how real trials run and are judged
    budget: {max_launches: 40, ...}               # optional: the study's global budget (all workers)
    workers: {heartbeat_s: 60, ...}               # optional: worker liveness on a shared storage
    slurm: {partition: gpu, ...}                  # optional: what 'dsopt slurm submit' writes

(the cluster sections are described in :mod:`optimizer.study.cluster_settings`)

Every key is checked: an unknown key, a wrong type or an impossible value raises
:class:`~optimizer.study.errors.UserError` naming the file, the dotted key and why. Files are read
with ``yaml.safe_load`` (:mod:`optimizer.study.yaml_file`, which also refuses repeated keys and base-60 numbers).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from optimizer.perf.hardware_profiles import profile_named
from optimizer.study import limits
from optimizer.study.cluster_settings import BudgetSettings, SlurmSettings, WorkerSettings
from optimizer.study.errors import UserError
from optimizer.study.hf_config import HfConfigError, canonical_json, shape_from_hf_config
from optimizer.study.knobs import Precision, parse_checkpointing
from optimizer.study.search_space import SearchSpace, parse_search_space
from optimizer.study.specs import (
    Accelerator,
    ActivationSource,
    AttentionKind,
    HardwareSpec,
    MlpKind,
    ModelInit,
    ModelSpec,
    NormKind,
    Optimizer,
    PositionKind,
    SeedModel,
    TrainingSpec,
    TransformerModel,
    TrialSettings,
)
from optimizer.study.units import parse_bytes, parse_count
from optimizer.study.yaml_file import read_yaml

T = TypeVar("T")
_MISSING = object()


@dataclass(frozen=True, kw_only=True, slots=True)
class StudySpec:
    """A parsed study: what to train, on what, and which knobs to search."""

    name: str
    """Study name; outputs go under ``studies/<name>/``."""
    path: Path
    """The study file."""
    model: ModelSpec
    """The model (seed mode or transformer mode)."""
    hardware: HardwareSpec
    """The machines."""
    training: TrainingSpec
    """Batch, sequence length, optimizer."""
    search_space: SearchSpace
    """The knobs' allowed values."""
    trial: TrialSettings
    """How real trials run and are judged."""
    budget: BudgetSettings = field(default_factory=BudgetSettings)
    """The study's global budget, all workers together."""
    workers: WorkerSettings = field(default_factory=WorkerSettings)
    """Worker liveness on a shared storage."""
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    """What ``dsopt slurm submit`` writes into the sbatch script."""

    @property
    def output_dir(self) -> Path:
        """Where the study's outputs go: ``studies/<name>/`` beside the study file (git-ignored)."""
        return self.path.parent / self.name


class _Section:
    """One mapping of the study file: typed reads that name the key on error, and no unknown keys."""

    def __init__(self, raw: object, *, source: str, key: str) -> None:
        if not isinstance(raw, Mapping):
            raise UserError(source=source, key=key, why=f"expected a mapping, got {type(raw).__name__}")
        self.raw: Mapping[str, Any] = raw
        self.source = source
        self.key = key
        self.seen: set[str] = set()

    def full_key(self, name: str) -> str:
        return f"{self.key}.{name}" if self.key else name

    def error(self, name: str, why: str) -> UserError:
        return UserError(source=self.source, key=self.full_key(name), why=why)

    def get(self, name: str, parse: Callable[[Any], T], default: Any = _MISSING) -> T:
        self.seen.add(name)
        if name not in self.raw or self.raw[name] is None:
            if default is _MISSING:
                raise self.error(name, "required key is missing")
            return default
        try:
            return parse(self.raw[name])
        except (ValueError, TypeError) as err:
            raise self.error(name, str(err)) from None

    def finish(self) -> None:
        unknown = sorted(set(self.raw) - self.seen, key=str)
        if unknown:
            allowed = ", ".join(sorted(self.seen))
            raise self.error(str(unknown[0]), f"unknown key; allowed here: {allowed}")


def _built(section: _Section, make: Callable[[], T]) -> T:
    """``make()`` a spec from the section's reads; its own ValueError names the key; then no unknown keys."""
    try:
        value = make()
    except ValueError as err:
        raise _spec_error(section, err) from None
    section.finish()
    return value


def _spec_error(section: _Section, err: ValueError) -> UserError:
    """A spec's own validation error, keyed by the field its message starts with (else the section)."""
    first = str(err).split(" ", 1)[0]
    key = section.full_key(first) if first in section.raw else section.key
    return UserError(source=section.source, key=key, why=str(err))


def _positive_int(value: Any) -> int:
    count = parse_count(value)
    if count < 1:
        raise ValueError(f"expected a positive whole number, got {value!r}")
    return count


def _count_within(limit: int, what: str) -> Callable[[Any], int]:
    """A positive whole number no greater than ``limit`` (:mod:`optimizer.study.limits`)."""
    def parse(value: Any) -> int:
        count = _positive_int(value)
        if why := limits.beyond(count, limit, what):
            raise ValueError(why)
        return count

    return parse


def _bytes_within(limit: int, what: str) -> Callable[[Any], int]:
    """A byte size no greater than ``limit`` (:mod:`optimizer.study.limits`)."""
    def parse(value: Any) -> int:
        size = parse_bytes(value)
        if why := limits.beyond(size, limit, what, unit="bytes"):
            raise ValueError(why)
        return size

    return parse


_POSITIONS = _count_within(limits.MAX_TOKENS, "context length")
_HOST_BYTES = _bytes_within(limits.MAX_HOST_BYTES, "host memory")
_DEVICE_BYTES = _bytes_within(limits.MAX_DEVICE_BYTES, "device memory")


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected text, got {type(value).__name__}")
    return value


def _path_text(value: Any) -> str:
    """A filesystem path: non-empty text on one line (``""`` would silently mean the current folder)."""
    text = _text(value)
    if not text.strip() or not text.isprintable():
        raise ValueError(f"expected a path (non-empty text on one line), got {value!r}")
    return text


def _name(value: Any) -> str:
    text = _text(value)
    if not text or not all(ch.isalnum() or ch in "-_." for ch in text) or text.startswith("."):
        raise ValueError(f"a study name may hold letters, digits, '-', '_' and '.', got {value!r}")
    return text


def _entry_point(value: Any) -> str:
    text = _text(value)
    module, sep, function = text.partition(":")
    if not sep or not module or not function:
        raise ValueError(f"expected 'module:function', got {value!r}")
    return text


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


_YAML12_FLOAT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
"""A decimal number as YAML 1.2 writes it. PyYAML follows YAML 1.1, whose floats need a dot and a signed
exponent, so ``1e-4`` and ``3e-3`` arrive as strings; people write them, and they mean the number."""


def _fraction(value: Any) -> float:
    """A finite real number: an int, a float, or a string that is a YAML 1.2 decimal (``1e-4``)."""
    if isinstance(value, str) and _YAML12_FLOAT.fullmatch(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def _enum(kind: type[T]) -> Callable[[Any], T]:
    def parse(value: Any) -> T:
        try:
            return kind(str(value).lower())  # type: ignore[call-arg]
        except ValueError:
            allowed = ", ".join(member.value for member in kind)  # type: ignore[attr-defined]
            raise ValueError(f"expected one of {allowed}, got {value!r}") from None

    return parse


def _activation_table(value: Any) -> dict[str, int]:
    if not isinstance(value, Mapping) or not value:
        raise ValueError("expected a mapping of checkpointing option -> bytes, e.g. {none: 8 GB, full: 3 GB}")
    table: dict[str, int] = {}
    for option, amount in value.items():
        try:
            canonical = str(parse_checkpointing(str(option)))
        except ValueError as err:
            raise ValueError(f"key {option!r}: {err}") from None
        try:
            table[canonical] = parse_bytes(amount)
        except ValueError as err:
            raise ValueError(f"{option}: {err}") from None
    return table


def _parse_model(section: _Section, *, sequence_length: int, study_dir: Path) -> ModelSpec:
    kind = section.get("kind", _enum_str(("seed", "transformer")))
    try:
        if kind == "seed":
            model: ModelSpec = SeedModel(
                parameters=section.get("parameters", _count_within(limits.MAX_PARAMETERS, "model")),
                activation_bytes=section.get("activation_bytes", _activation_table),
                activation_precision=section.get("activation_precision", _enum(Precision), Precision.FP32),
                buffer_bytes=section.get("buffer_bytes", _DEVICE_BYTES, 0),
            )
        elif "hf_config" in section.raw:
            model = TransformerModel(
                **_hf_shape(section, study_dir=study_dir),
                attention=section.get("attention", _enum(AttentionKind), AttentionKind.EAGER),
                activations=section.get("activations", _enum(ActivationSource), ActivationSource.AUTO),
            )
        else:
            heads = section.get("heads", _count_within(limits.MAX_WIDTH, "attention head count"))
            hidden = section.get("hidden_size", _count_within(limits.MAX_WIDTH, "hidden size"))
            model = TransformerModel(
                layers=section.get("layers", _count_within(limits.MAX_LAYERS, "layer count")),
                hidden_size=hidden,
                heads=heads,
                kv_heads=section.get("kv_heads", _count_within(limits.MAX_WIDTH, "key/value head count"), heads),
                ffn_size=section.get("ffn_size", _count_within(limits.MAX_FFN, "MLP width"), 4 * hidden),
                vocab_size=section.get("vocab_size", _count_within(limits.MAX_VOCAB, "vocabulary")),
                tied_embeddings=section.get("tied_embeddings", _bool, True),
                attention=section.get("attention", _enum(AttentionKind), AttentionKind.EAGER),
                mlp=section.get("mlp", _enum(MlpKind), MlpKind.GELU),
                norm=section.get("norm", _enum(NormKind), NormKind.LAYERNORM),
                bias=section.get("bias", _bool, True),
                position_embedding=section.get("position_embedding", _enum(PositionKind), PositionKind.LEARNED),
                dropout=section.get("dropout", _bool, True),
                max_positions=section.get("max_positions", _POSITIONS, sequence_length),
                entry_point=section.get("entry_point", _entry_point, None),
                activations=section.get("activations", _enum(ActivationSource), ActivationSource.AUTO),
            )
    except ValueError as err:
        raise _spec_error(section, err) from None
    section.finish()
    return model


SHAPE_KEYS = ("layers", "hidden_size", "heads", "kv_heads", "ffn_size", "vocab_size", "tied_embeddings", "mlp",
              "norm", "bias", "position_embedding", "dropout", "max_positions", "entry_point")
"""Model keys an ``hf_config`` already answers (or, for entry_point, contradicts)."""


def _unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (``json`` keeps the last of a repeated key silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_json_constant(name: str) -> Any:
    """``json``'s hook for ``NaN``/``Infinity``, which JSON itself does not have."""
    raise ValueError(f"{name} is not a JSON number")


def _hf_shape(section: _Section, *, study_dir: Path) -> dict[str, Any]:
    """The shape fields and canonical JSON of ``model.hf_config``: an inline mapping or a config.json path
    (relative to the study file). Errors name the config file (or the study's key) and the config's key."""
    clash = next((key for key in SHAPE_KEYS if key in section.raw), None)
    if clash is not None:
        raise section.error(clash, "comes from hf_config; give one or the other")
    value = section.get("hf_config", lambda v: v)
    if isinstance(value, Mapping):  # YAML 1.1 reads `rms_norm_eps: 1e-6` as a string: JSON (and the user) mean 1e-6
        config = {k: float(v) if isinstance(v, str) and _YAML12_FLOAT.fullmatch(v.strip()) else v
                  for k, v in value.items()}
        source, prefix = section.source, section.full_key("hf_config") + "."
    elif isinstance(value, str):
        path = Path(value) if Path(value).is_absolute() else study_dir / value
        if not path.is_file():
            raise section.error("hf_config", f"no such file: {path}")
        try:
            config = json.loads(path.read_text(), object_pairs_hook=_unique_json_object,
                                parse_constant=_no_json_constant)
        except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise UserError(source=str(path), key="", why=f"not a JSON config: {err}") from None
        if not isinstance(config, dict):
            raise UserError(source=str(path), key="", why="expected a JSON object (a transformers config.json)")
        source, prefix = str(path), ""
    else:
        raise section.error("hf_config", "expected a mapping (the config's keys) or a path to a config.json")
    try:
        shape = shape_from_hf_config(config)
    except HfConfigError as err:
        raise UserError(source=source, key=prefix + err.key, why=str(err).split(": ", 1)[1]) from None
    return {**shape, "hf_config": canonical_json(config)}


def _enum_str(allowed: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {value!r}")
        return str(value)

    return parse


def _parse_hardware(section: _Section) -> HardwareSpec:
    accelerator = section.get("accelerator", _enum(Accelerator), Accelerator.CUDA)
    default_precisions = (
        (Precision.FP32, Precision.BF16) if accelerator is Accelerator.CPU else tuple(Precision)
    )
    nvme_path = section.get("nvme_path", _path_text, None)
    nvme_bytes = section.get("nvme_capacity", _bytes_within(limits.MAX_NVME_BYTES, "NVMe capacity"), None)
    if nvme_path is not None and nvme_bytes is None:
        # The capacity is read from the path itself: the path must then exist here.
        if not Path(nvme_path).is_dir():
            raise section.error("nvme_path", f"{nvme_path!r} is not an existing directory "
                                "(give hardware.nvme_capacity to plan for another machine)")
        nvme_bytes = shutil.disk_usage(nvme_path).free
    try:
        hardware = HardwareSpec(
            accelerator=accelerator,
            nodes=section.get("nodes", _count_within(limits.MAX_DEVICES, "node count"), 1),
            gpus_per_node=section.get("gpus_per_node", _count_within(limits.MAX_DEVICES, "devices per node")),
            gpu_memory_bytes=section.get("gpu_memory", _DEVICE_BYTES),
            device_reserve_bytes=section.get("device_reserve", _DEVICE_BYTES, 0),
            allocator_overhead=section.get("allocator_overhead", _fraction, 0.0),
            host_memory_bytes=section.get("host_memory", _HOST_BYTES, None),
            nvme_path=nvme_path,
            nvme_bytes=nvme_bytes,
            supported_precisions=section.get("supported_precisions", _precision_list, default_precisions),
            profile=section.get("profile", _profile, None),
            inter_node_bytes_per_s=section.get("inter_node_bandwidth", _bandwidth, None),
            nvme_bytes_per_s=section.get("nvme_bandwidth", _bandwidth, None),
        )
    except ValueError as err:
        raise _spec_error(section, err) from None
    section.finish()
    return hardware


def _profile(value: Any) -> str:
    return profile_named(_text(value)).name


def _bandwidth(value: Any) -> float:
    text = str(value).strip()
    if not text.endswith("/s"):
        raise ValueError(f"expected a bandwidth such as '50 GB/s', got {value!r}")
    rate = float(parse_bytes(text.removesuffix("/s").strip()))
    if rate <= 0:
        raise ValueError(f"expected a bandwidth above 0, got {value!r}")
    return rate


def _precision_list(value: Any) -> tuple[Precision, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("expected a non-empty list such as [fp32, bf16]")
    return tuple(_enum(Precision)(item) for item in value)


def _parse_training(section: _Section) -> TrainingSpec:
    return _built(section, lambda: TrainingSpec(
        global_batch_size=section.get("global_batch_size", _count_within(limits.MAX_BATCH, "batch")),
        micro_batch_size=section.get("micro_batch_size", _count_within(limits.MAX_BATCH, "batch")),
        sequence_length=section.get("sequence_length", _count_within(limits.MAX_TOKENS, "sequence length")),
        optimizer=section.get("optimizer", _enum(Optimizer), Optimizer.ADAM),
        learning_rate=section.get("learning_rate", _fraction, 1e-3),
        weight_decay=section.get("weight_decay", _fraction, 0.0),
        model_init=section.get("model_init", _enum(ModelInit), ModelInit.AUTO),
    ))


def _tolerances(value: Any) -> tuple[tuple[Precision, float], ...]:
    if not isinstance(value, Mapping) or not value:
        raise ValueError("expected a mapping of precision -> relative tolerance, e.g. {fp32: 1e-4, bf16: 5e-2}")
    table = dict(TrialSettings().fidelity_tolerance)
    for key, tolerance in value.items():
        precision = _enum(Precision)(key)
        number = _fraction(tolerance)
        if not number > 0:
            raise ValueError(f"{key}: a tolerance must be > 0, got {tolerance!r}")
        table[precision] = number
    return tuple(table.items())


def _parse_trial(section: _Section) -> TrialSettings:
    defaults = TrialSettings()
    return _built(section, lambda: TrialSettings(
        warmup_steps=section.get("warmup_steps", _positive_int, defaults.warmup_steps),
        measured_steps=section.get("measured_steps", _positive_int, defaults.measured_steps),
        timeout_s=section.get("timeout_s", _fraction, defaults.timeout_s),
        seed=section.get("seed", parse_count, defaults.seed),
        retries=section.get("retries", parse_count, defaults.retries),
        fidelity_tolerance=section.get("fidelity_tolerance", _tolerances, defaults.fidelity_tolerance),
    ))


def _deadline(value: Any) -> datetime:
    if isinstance(value, datetime):  # YAML reads an unquoted ISO 8601 timestamp as a datetime
        moment = value
    else:
        try:
            moment = datetime.fromisoformat(_text(value))
        except ValueError:
            raise ValueError(f"expected an ISO 8601 instant such as 2026-11-30T07:00:00+00:00, got {value!r}") from None
    if moment.tzinfo is None:
        raise ValueError(f"{value!r} has no timezone; write e.g. 2026-11-30T07:00:00+00:00")
    return moment


def _text_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError("expected a list of text items")
    return tuple(value)


_SLURM_TIME = re.compile(r"(\d+)(:\d{1,2}){0,2}|(\d+)-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)
"""``--time`` as sbatch(1) accepts it: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
days-hours:minutes, days-hours:minutes:seconds, or UNLIMITED/INFINITE."""
_SLURM_MEM = re.compile(r"\d+[KMGT]?", re.IGNORECASE)
"""``--mem`` as sbatch(1) accepts it: a whole number, megabytes unless suffixed K, M, G or T (0: all of it)."""


def _sbatch_format(pattern: re.Pattern[str], what: str) -> Callable[[Any], str]:
    """Text (or a whole number) that ``pattern`` matches whole; else why, naming the sbatch format."""
    def parse(value: Any) -> str:
        text = _count_text(value)
        if not pattern.fullmatch(text):
            raise ValueError(f"{text!r} is not a SLURM {what}")
        return text

    return parse


_slurm_time = _sbatch_format(_SLURM_TIME, "time (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or "
                                          "UNLIMITED; see sbatch --time)")
_slurm_mem = _sbatch_format(_SLURM_MEM, "memory size (a whole number with an optional K, M, G or T suffix, "
                                        "megabytes by default; 0 = all of the node's; see sbatch --mem)")


def _count_text(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"expected text or a whole number, got {value!r}")
    return str(value)


def _parse_budget(section: _Section) -> BudgetSettings:
    return _built(section, lambda: BudgetSettings(
        max_launches=section.get("max_launches", _positive_int, None),
        deadline=section.get("deadline", _deadline, None),
        max_hours=section.get("max_hours", _fraction, None),
    ))


def _parse_workers(section: _Section) -> WorkerSettings:
    defaults = WorkerSettings()
    heartbeat = section.get("heartbeat_s", _positive_int, defaults.heartbeat_s)
    return _built(section, lambda: WorkerSettings(
        heartbeat_s=heartbeat,
        grace_s=section.get("grace_s", _positive_int, max(defaults.grace_s, 3 * heartbeat)),
        max_retry=section.get("max_retry", parse_count, defaults.max_retry),
    ))


def _parse_slurm(section: _Section) -> SlurmSettings:
    return _built(section, lambda: SlurmSettings(
        partition=section.get("partition", _text, None),
        account=section.get("account", _text, None),
        time=section.get("time", _slurm_time, None),
        cpus_per_task=section.get("cpus_per_task", _positive_int, None),
        mem=section.get("mem", _slurm_mem, None),
        sbatch=section.get("sbatch", _text_list, ()),
        setup=section.get("setup", _text_list, ()),
        python=section.get("python", _text, None),
    ))


def _parse_space_ref(value: object, *, study_path: Path) -> SearchSpace:
    source = str(study_path)
    if isinstance(value, str):
        space_path = (study_path.parent / value).resolve() if not Path(value).is_absolute() else Path(value)
        if not space_path.is_file():
            raise UserError(source=source, key="search_space", why=f"search-space file {value!r} not found "
                            f"(looked at {space_path})")
        raw = read_yaml(space_path, what="search-space file")
        return parse_search_space(raw, source=str(space_path))
    if isinstance(value, Mapping):
        return parse_search_space(value, source=source, key_prefix="search_space")
    raise UserError(source=source, key="search_space", why="expected a path to a search_spaces/*.yaml file or an "
                    "inline mapping with 'knobs'")


def load_study(path: str | Path) -> StudySpec:
    """Read and validate the study file at ``path``; raise :class:`UserError` on any mistake."""
    study_path = Path(path)
    raw = read_yaml(study_path, what="study file")
    source = str(study_path)
    top = _Section(raw if raw is not None else {}, source=source, key="")
    name = top.get("name", _name, study_path.stem)
    top.get("description", _text, "")
    training = _parse_training(_Section(top.get("training", lambda v: v), source=source, key="training"))
    model = _parse_model(
        _Section(top.get("model", lambda v: v), source=source, key="model"),
        sequence_length=training.sequence_length,
        study_dir=study_path.parent,
    )
    hardware = _parse_hardware(_Section(top.get("hardware", lambda v: v), source=source, key="hardware"))
    space = _parse_space_ref(top.get("search_space", lambda v: v), study_path=study_path)
    trial = _parse_trial(_Section(top.get("trial", lambda v: v, {}), source=source, key="trial"))
    budget = _parse_budget(_Section(top.get("budget", lambda v: v, {}), source=source, key="budget"))
    workers = _parse_workers(_Section(top.get("workers", lambda v: v, {}), source=source, key="workers"))
    slurm = _parse_slurm(_Section(top.get("slurm", lambda v: v, {}), source=source, key="slurm"))
    top.finish()
    stages = dict(space.values).get("zero_stage", (0,))
    if training.model_init is ModelInit.ZERO_INIT and 3 not in stages:
        raise UserError(source=source, key="training.model_init",
                        why="zero_init (deepspeed.zero.Init) builds a partitioned model that only ZeRO stage 3 trains, "
                            f"and the search space holds zero_stage {', '.join(str(int(s)) for s in stages)} only")
    per_step = training.micro_batch_size * hardware.world_size
    if training.global_batch_size % per_step:
        raise UserError(source=source, key="training.micro_batch_size",
                        why=f"the baseline micro-batch {training.micro_batch_size} x {hardware.world_size} ranks = "
                            f"{per_step} does not divide global_batch_size={training.global_batch_size}")
    return StudySpec(name=name, path=study_path.resolve(), model=model, hardware=hardware, training=training,
                     search_space=space, trial=trial, budget=budget, workers=workers, slurm=slurm)
