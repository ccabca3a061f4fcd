"""The study file's ``model`` section: a shape, a seed-mode model, or a ``transformers`` config (inline or a
config.json path) — with errors about a config naming the config file and its key (pure)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from optimizer.study import limits
from optimizer.study.errors import UserError
from optimizer.study.fields import (
    DEVICE_BYTES,
    POSITIONS,
    YAML12_FLOAT,
    Section,
    as_bool,
    as_entry_point,
    as_enum,
    as_enum_str,
    count_within,
    spec_error,
)
from optimizer.study.hf_config import HfConfigError, canonical_json, shape_from_hf_config
from optimizer.study.knobs import Precision, parse_checkpointing
from optimizer.study.peft_section import parse_peft
from optimizer.study.quantization_section import parse_quantization
from optimizer.study.specs import (
    LM_HEADS,
    ActivationSource,
    AttentionKind,
    MlpKind,
    ModelSpec,
    NormKind,
    PositionKind,
    SeedModel,
    TransformerModel,
)
from optimizer.study.units import parse_size


def activation_table(value: Any) -> dict[str, int]:
    if not isinstance(value, Mapping) or not value:
        raise ValueError("expected a mapping of checkpointing option -> bytes, e.g. {none: 8 GB, full: 3 GB}")
    table: dict[str, int] = {}
    for option, amount in value.items():
        try:
            canonical = str(parse_checkpointing(str(option)))
        except ValueError as err:
            raise ValueError(f"key {option!r}: {err}") from None
        try:
            table[canonical] = parse_size(amount)  # a unit is required: '8 GB', not 8
        except ValueError as err:
            raise ValueError(f"{option}: {err}") from None
    return table


def parse_model(section: Section, *, sequence_length: int, study_dir: Path,
                frozen: tuple[str, ...] = (), reference_model: bool = False,
                sequences_per_sample: int = 1) -> ModelSpec:
    """The ``model`` section; ``frozen`` is ``training.frozen`` (what of this model does not train),
    ``reference_model`` is ``training.reference_model`` (a frozen copy held beside it), ``sequences_per_sample`` is
    ``training.sequences_per_sample`` (rows the model runs per sample)."""
    kind = section.get("kind", as_enum_str(("seed", "transformer")))
    peft = section.get("peft", lambda v: parse_peft(v, source=section.source, key=section.full_key("peft"),
                                                     study_dir=study_dir), None)
    quantization = section.get("quantization", lambda v: parse_quantization(
        v, source=section.source, key=section.full_key("quantization")), None)
    lm_head = section.get("lm_head", as_enum_str(LM_HEADS), "logits")
    if lm_head != "logits" and "hf_config" not in section.raw:
        raise UserError(source=section.source, key=section.full_key("lm_head"), why=f"{lm_head} is TRL's fused head "
                        "on a transformers model: give the model as hf_config (a config.json)")
    if quantization is not None and "hf_config" not in section.raw:
        raise UserError(source=section.source, key=section.full_key("quantization"), why="a 4-bit base is what "
                        "transformers' bitsandbytes quantizer makes of a transformers model: give the model as "
                        "hf_config (a config.json)")
    if kind == "seed" and (peft is not None or frozen or reference_model or quantization is not None):
        key = (section.full_key("peft") if peft is not None else "training.frozen" if frozen
               else section.full_key("quantization") if quantization is not None else "training.reference_model")
        raise UserError(source=section.source, key=key, why="a seed-mode model states its parameters as one "
                        "number: what trains needs a transformer model (hf_config, shape keys or an entry point)")
    if kind == "seed" and sequences_per_sample != 1:
        raise UserError(source=section.source, key="training.sequences_per_sample", why="a seed-mode model states "
                        "its activation bytes per micro-batch of samples already: give them for the rows it runs, "
                        "or describe the model as a transformer (hf_config, shape keys or an entry point)")
    try:
        if kind == "seed":
            model: ModelSpec = SeedModel(
                parameters=section.get("parameters", count_within(limits.MAX_PARAMETERS, "model")),
                activation_bytes=section.get("activation_bytes", activation_table),
                activation_precision=section.get("activation_precision", as_enum(Precision), Precision.FP32),
                buffer_bytes=section.get("buffer_bytes", DEVICE_BYTES, 0),
            )
        elif "hf_config" in section.raw:
            model = TransformerModel(
                **hf_shape(section, study_dir=study_dir),
                attention=section.get("attention", as_enum(AttentionKind), AttentionKind.EAGER),
                activations=section.get("activations", as_enum(ActivationSource), ActivationSource.AUTO),
                peft=peft, frozen=frozen, reference_model=reference_model, quantization=quantization,
                sequences_per_sample=sequences_per_sample,
                lm_head=lm_head,
            )
        else:
            heads = section.get("heads", count_within(limits.MAX_WIDTH, "attention head count"))
            hidden = section.get("hidden_size", count_within(limits.MAX_WIDTH, "hidden size"))
            model = TransformerModel(
                layers=section.get("layers", count_within(limits.MAX_LAYERS, "layer count")),
                hidden_size=hidden,
                heads=heads,
                kv_heads=section.get("kv_heads", count_within(limits.MAX_WIDTH, "key/value head count"), heads),
                ffn_size=section.get("ffn_size", count_within(limits.MAX_FFN, "MLP width"), 4 * hidden),
                vocab_size=section.get("vocab_size", count_within(limits.MAX_VOCAB, "vocabulary")),
                tied_embeddings=section.get("tied_embeddings", as_bool, True),
                attention=section.get("attention", as_enum(AttentionKind), AttentionKind.EAGER),
                mlp=section.get("mlp", as_enum(MlpKind), MlpKind.GELU),
                norm=section.get("norm", as_enum(NormKind), NormKind.LAYERNORM),
                bias=section.get("bias", as_bool, True),
                position_embedding=section.get("position_embedding", as_enum(PositionKind), PositionKind.LEARNED),
                dropout=section.get("dropout", as_bool, True),
                max_positions=section.get("max_positions", POSITIONS, sequence_length),
                entry_point=section.get("entry_point", as_entry_point, None),
                activations=section.get("activations", as_enum(ActivationSource), ActivationSource.AUTO),
                peft=peft, frozen=frozen, reference_model=reference_model,
                sequences_per_sample=sequences_per_sample,
            )
    except ValueError as err:
        raise spec_error(section, err) from None
    section.finish()
    return model


SHAPE_KEYS = ("layers", "hidden_size", "heads", "kv_heads", "ffn_size", "vocab_size", "tied_embeddings", "mlp",
              "norm", "bias", "position_embedding", "dropout", "max_positions", "entry_point")
"""Model keys an ``hf_config`` already answers (or, for entry_point, contradicts)."""


def unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (``json`` keeps the last of a repeated key silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def no_json_constant(name: str) -> Any:
    """``json``'s hook for ``NaN``/``Infinity``, which JSON itself does not have."""
    raise ValueError(f"{name} is not a JSON number")


def hf_shape(section: Section, *, study_dir: Path) -> dict[str, Any]:
    """The shape fields and canonical JSON of ``model.hf_config``: an inline mapping or a config.json path
    (relative to the study file). Errors name the config file (or the study's key) and the config's key."""
    clash = next((key for key in SHAPE_KEYS if key in section.raw), None)
    if clash is not None:
        raise section.error(clash, "comes from hf_config; give one or the other")
    value = section.get("hf_config", lambda v: v)
    if isinstance(value, Mapping):  # YAML 1.1 reads `rms_norm_eps: 1e-6` as a string: JSON (and the user) mean 1e-6
        config = {k: float(v) if isinstance(v, str) and YAML12_FLOAT.fullmatch(v.strip()) else v
                  for k, v in value.items()}
        source, prefix = section.source, section.full_key("hf_config") + "."
    elif isinstance(value, str):
        path = Path(value) if Path(value).is_absolute() else study_dir / value
        if not path.is_file():
            raise section.error("hf_config", f"no such file: {path}")
        try:
            config = json.loads(path.read_text(), object_pairs_hook=unique_json_object,
                                parse_constant=no_json_constant)
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


