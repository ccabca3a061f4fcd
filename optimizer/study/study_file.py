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

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from optimizer.study import limits
from optimizer.study.cluster_settings import (
    BudgetSettings,
    SlurmSettings,
    WorkerSettings,
    parse_budget,
    parse_slurm,
    parse_workers,
)
from optimizer.study.cross_checks import check_positions
from optimizer.study.errors import UserError
from optimizer.study.fields import (
    Section,
    as_bool,
    as_enum,
    as_fraction,
    as_positive_int,
    as_study_name,
    as_text,
    built,
    count_within,
)
from optimizer.study.hardware_section import parse_hardware
from optimizer.study.knobs import Precision
from optimizer.study.model_section import parse_model
from optimizer.study.peft_section import parse_frozen
from optimizer.study.quantization_section import FourBitBase
from optimizer.study.script_command import ScriptCommand, uncovered_knobs
from optimizer.study.search_space import SearchSpace, parse_search_space
from optimizer.study.specs import (
    HardwareSpec,
    ModelInit,
    ModelSpec,
    Optimizer,
    SeedModel,
    TrainingSpec,
    TransformerModel,
)
from optimizer.study.trial_settings import TrialSettings
from optimizer.study.units import parse_count
from optimizer.study.yaml_file import read_yaml


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


def _parse_training(section: Section) -> tuple[TrainingSpec, dict[str, Any]]:
    """The training section, and ``training.frozen``, ``training.reference_model`` and
    ``training.sequences_per_sample`` as :func:`parse_model`'s keyword arguments (kept on the model spec: they say
    what of the model trains, what the ranks build beside it and how many rows it runs per sample)."""
    extras = {"frozen": section.get("frozen", parse_frozen, ()),
              "reference_model": section.get("reference_model", as_bool, False),
              "sequences_per_sample": section.get("sequences_per_sample",
                                                  count_within(limits.MAX_SEQUENCES_PER_SAMPLE, "sequences"), 1)}
    return built(section, lambda: TrainingSpec(
        global_batch_size=section.get("global_batch_size", count_within(limits.MAX_BATCH, "batch")),
        micro_batch_size=section.get("micro_batch_size", count_within(limits.MAX_BATCH, "batch")),
        sequence_length=section.get("sequence_length", count_within(limits.MAX_TOKENS, "sequence length")),
        optimizer=section.get("optimizer", as_enum(Optimizer), Optimizer.ADAM),
        learning_rate=section.get("learning_rate", as_fraction, 1e-3),
        weight_decay=section.get("weight_decay", as_fraction, 0.0),
        model_init=section.get("model_init", as_enum(ModelInit), ModelInit.AUTO),
    )), extras


def _tolerances(value: Any) -> tuple[tuple[Precision, float], ...]:
    if not isinstance(value, Mapping) or not value:
        raise ValueError("expected a mapping of precision -> relative tolerance, e.g. {fp32: 1e-4, bf16: 5e-2}")
    table = dict(TrialSettings().fidelity_tolerance)
    for key, tolerance in value.items():
        precision = as_enum(Precision)(key)
        number = as_fraction(tolerance)
        if not number > 0:
            raise ValueError(f"{key}: a tolerance must be > 0, got {tolerance!r}")
        table[precision] = number
    return tuple(table.items())


def _argv(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list):
        raise ValueError("expected a list of strings, e.g. ['python', 'train.py', '--deepspeed', '{ds_config}'] "
                         "(a list, so that no shell splits or expands it)")
    if not all(isinstance(a, str) for a in value):
        raise ValueError(f"every argument must be a string (quote numbers), got {value!r}")
    return tuple(value)


def _script_command(section: Section) -> ScriptCommand | None:
    argv = section.get("command", _argv, None)
    style = section.get("ds_config_style", as_text, None)
    tokens = section.get("tokens_per_sample", count_within(limits.MAX_TOKENS, "tokens"), None)
    if argv is None:
        for name, value in (("ds_config_style", style), ("tokens_per_sample", tokens)):
            if value is not None:
                raise section.error(name, "only a study with trial.command (the user's own script) takes it")
        return None
    try:
        return ScriptCommand(argv=argv, ds_config_style=style or "plain", tokens_per_sample=tokens)
    except ValueError as err:
        key = "ds_config_style" if "ds_config_style" in str(err) else "command"
        raise section.error(key, str(err)) from None


def _parse_trial(section: Section) -> TrialSettings:
    defaults = TrialSettings()
    command = _script_command(section)
    return built(section, lambda: TrialSettings(
        command=command,
        warmup_steps=section.get("warmup_steps", as_positive_int, defaults.warmup_steps),
        measured_steps=section.get("measured_steps", as_positive_int, defaults.measured_steps),
        timeout_s=section.get("timeout_s", as_fraction, defaults.timeout_s),
        seed=section.get("seed", parse_count, defaults.seed),
        retries=section.get("retries", parse_count, defaults.retries),
        fidelity_tolerance=section.get("fidelity_tolerance", _tolerances, defaults.fidelity_tolerance),
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


def _check_script(command: ScriptCommand, *, space: SearchSpace, study_path: Path, model: ModelSpec) -> None:
    """Refuse a script study whose command cannot carry a searched knob, whose script is not there, or whose model
    section cannot plan (:mod:`optimizer.study.script_command`)."""
    source = str(study_path)
    if isinstance(model, SeedModel):
        raise UserError(source=source, key="trial.command", why="a seed-mode model has no shape to plan a script "
                        "with: describe the script's model (hf_config, shape keys or an entry point)")
    searched = {name: [str(v) for v in values] for name, values in space.values if len(values) > 1}
    missing = uncovered_knobs(command, searched)
    if missing:
        raise UserError(source=source, key="trial.command", why="a searched knob cannot reach the script: "
                        + "; ".join(missing) + " (or search one value of it)")
    script = command.script
    if script is not None and not (study_path.parent / script).is_file():
        raise UserError(source=source, key="trial.command", why=f"script {script!r} not found (looked at "
                        f"{(study_path.parent / script).resolve()}; the command runs in the study file's folder)")


def _four_bit_training(model: TransformerModel, training: TrainingSpec, *, space: SearchSpace,
                       source: str) -> TrainingSpec:
    """A QLoRA study's training spec, checked. transformers enters no ``deepspeed.zero.Init`` for a quantized
    model (``modeling_utils.py:1435``, ``needs_zero3_init = ... and not _is_quantized``): the 4-bit model arrives
    whole on every rank and ZeRO-3 partitions it in ``deepspeed.initialize`` — ``model_init: auto`` means
    ``device`` here, and ``zero_init`` is refused. A search space none of whose (stage, precision) pairs can hold
    the 4-bit weights' storage dtype is refused too (single candidates: :func:`optimizer.study.constraints`)."""
    base = FourBitBase.from_json(model.quantization or "")
    if training.model_init is ModelInit.ZERO_INIT:
        raise UserError(source=source, key="training.model_init", why="transformers builds a quantized model "
                        "without deepspeed.zero.Init (modeling_utils.py:1435): use model_init auto or device")
    values = dict(space.values)
    pairs = [(int(stage), Precision(precision)) for stage in values.get("zero_stage", (0,))
             for precision in values.get("precision", (Precision.FP32,))]
    problems = [base.storage_problem(zero3=stage == 3, training_dtype=precision.torch_dtype_name)
                for stage, precision in pairs]
    if all(problems):
        raise UserError(source=source, key="model.quantization.bnb_4bit_quant_storage",
                        why=f"no candidate of the search space can hold the 4-bit weights: {problems[0]}")
    if training.model_init is ModelInit.AUTO:
        return replace(training, model_init=ModelInit.DEVICE)
    return training


def load_study(path: str | Path) -> StudySpec:
    """Read and validate the study file at ``path``; raise :class:`UserError` on any mistake."""
    study_path = Path(path)
    raw = read_yaml(study_path, what="study file")
    source = str(study_path)
    top = Section(raw if raw is not None else {}, source=source, key="")
    name = top.get("name", as_study_name, study_path.stem)
    top.get("description", as_text, "")
    training, extras = _parse_training(Section(top.get("training", lambda v: v), source=source, key="training"))
    model = parse_model(
        Section(top.get("model", lambda v: v), source=source, key="model"),
        sequence_length=training.sequence_length,
        study_dir=study_path.parent,
        **extras,
    )
    hardware = parse_hardware(Section(top.get("hardware", lambda v: v), source=source, key="hardware"))
    space = _parse_space_ref(top.get("search_space", lambda v: v), study_path=study_path)
    trial = _parse_trial(Section(top.get("trial", lambda v: v, {}), source=source, key="trial"))
    budget = parse_budget(Section(top.get("budget", lambda v: v, {}), source=source, key="budget"))
    workers = parse_workers(Section(top.get("workers", lambda v: v, {}), source=source, key="workers"))
    slurm = parse_slurm(Section(top.get("slurm", lambda v: v, {}), source=source, key="slurm"))
    top.finish()
    check_positions(model=model, training=training, source=source)
    stages = dict(space.values).get("zero_stage", (0,))
    if training.model_init is ModelInit.ZERO_INIT and 3 not in stages:
        raise UserError(source=source, key="training.model_init",
                        why="zero_init (deepspeed.zero.Init) builds a partitioned model that only ZeRO stage 3 trains, "
                            f"and the search space holds zero_stage {', '.join(str(int(s)) for s in stages)} only")
    if isinstance(model, TransformerModel) and model.quantization is not None:
        training = _four_bit_training(model, training, space=space, source=source)
    if trial.command is not None:
        _check_script(trial.command, space=space, study_path=study_path, model=model)
    per_step = training.micro_batch_size * hardware.world_size
    if training.global_batch_size % per_step:
        raise UserError(source=source, key="training.micro_batch_size",
                        why=f"the baseline micro-batch {training.micro_batch_size} x {hardware.world_size} ranks = "
                            f"{per_step} does not divide global_batch_size={training.global_batch_size}")
    return StudySpec(name=name, path=study_path.resolve(), model=model, hardware=hardware, training=training,
                     search_space=space, trial=trial, budget=budget, workers=workers, slurm=slurm)
