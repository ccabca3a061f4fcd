"""A 4-bit base (QLoRA): the study file's ``model.quantization``, checked before any work (pure).

The mapping takes ``transformers.BitsAndBytesConfig``'s own field names (transformers 5.25,
``utils/quantization_config.py``), with its defaults: ``bnb_4bit_quant_type`` fp4, ``bnb_4bit_compute_dtype``
float32, ``bnb_4bit_quant_storage`` uint8, ``bnb_4bit_use_double_quant`` false. dsopt plans 4-bit bases
(``load_in_4bit: true``); an 8-bit base (``load_in_8bit``, LLM.int8) is refused as not planned, as is CPU offload of
whole modules (``llm_int8_enable_fp32_cpu_offload``) and any field BitsAndBytesConfig does not have.

Which Linear layers turn 4-bit is transformers' rule (``quantizers/quantizer_bnb_4bit.py``
``_process_model_before_weight_loading``): every ``nn.Linear`` (and GPT-2's ``Conv1D``) except the output embedding,
the last module, tied weights (``quantizers/base.py`` ``get_keys_to_not_convert``) and ``llm_int8_skip_modules``;
:mod:`launchers.trace.inventory` applies that rule to the built model.

Kept as canonical JSON (sorted keys, every field at its value or default) on
:class:`~optimizer.study.specs.TransformerModel`, like ``model.peft``: it is part of what the ranks build.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from optimizer.study.errors import UserError

QUANT_TYPES = ("fp4", "nf4")
"""``bnb_4bit_quant_type``: bitsandbytes' two 4-bit codebooks."""
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
"""``bnb_4bit_compute_dtype``: the dtype a 4-bit weight is dequantized to for each matmul."""
STORAGE_BYTES = {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
"""``bnb_4bit_quant_storage`` (the values BitsAndBytesConfig accepts) and their element sizes: the packed 4-bit bytes
are viewed as elements of this dtype (``bitsandbytes/backends/default/ops.py``), which is what ZeRO-3 partitions."""
FLOAT_STORAGE = ("bfloat16", "float16", "float32", "float64")
"""Storage dtypes that are floating point: DeepSpeed's module cast (``engine.py:1851-1862``, ``module.bfloat16()``
casts floating tensors only) rewrites their bytes unless they are the training dtype already."""

_PLANNED = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
            "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage", "llm_int8_skip_modules")
_INERT = ("llm_int8_threshold", "llm_int8_has_fp16_weight", "quant_method", "llm_int8_enable_fp32_cpu_offload")
"""Fields that act on 8-bit layers or on device maps only: accepted at values that change nothing for a 4-bit base."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FourBitBase:
    """The study's 4-bit base, as bitsandbytes quantizes it."""

    quant_type: str = "fp4"
    """``bnb_4bit_quant_type``: fp4 or nf4."""
    double_quant: bool = False
    """``bnb_4bit_use_double_quant``: the absmax quantized again (≈ 0.516 instead of 0.5625 bytes per weight)."""
    compute_dtype: str = "float32"
    """``bnb_4bit_compute_dtype``: each matmul dequantizes its weight to this dtype."""
    storage: str = "uint8"
    """``bnb_4bit_quant_storage``: the dtype the packed bytes are held as."""
    skip_modules: tuple[str, ...] = ()
    """``llm_int8_skip_modules``: module names kept unquantized beside transformers' own list."""
    blocksize: int = 64
    """Elements per absmax (``Linear4bit``'s default; not a BitsAndBytesConfig field)."""

    @property
    def storage_bytes(self) -> int:
        """Bytes per storage element."""
        return STORAGE_BYTES[self.storage]

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype (what a 4-bit weight is dequantized to)."""
        return STORAGE_BYTES[self.compute_dtype]

    def label(self) -> str:
        """``4-bit nf4 (double quant, bf16 storage)`` — what the plan and the export print."""
        extras = [*(["double quant"] if self.double_quant else []),
                  *([f"{self.storage} storage"] if self.storage != "uint8" else []),
                  f"compute {self.compute_dtype}"]
        return f"4-bit {self.quant_type} ({', '.join(extras)})"

    def storage_problem(self, *, zero3: bool, training_dtype: str) -> str | None:
        """Why a candidate at this stage and training dtype cannot hold this base, or None.

        ZeRO-3 partitions and all-gathers the packed weights like any parameter: they must be of the training dtype
        (transformers' DeepSpeed/FSDP-QLoRA guide: ``bnb_4bit_quant_storage`` = the model's dtype). Below ZeRO-3 a
        16-bit engine casts every floating tensor of the module to its dtype (``engine.py:1851-1862``,
        ``module.bfloat16()``/``.half()``): a floating storage dtype other than it would be rewritten; uint8 (the
        default) is left alone, and an fp32 engine casts nothing."""
        if zero3 and self.storage != training_dtype:
            return (f"zero_stage 3 partitions the 4-bit weights as parameters: model.quantization."
                    f"bnb_4bit_quant_storage must be the training dtype {training_dtype}, not {self.storage}")
        if training_dtype != "float32" and self.storage in FLOAT_STORAGE and self.storage != training_dtype:
            return (f"DeepSpeed casts every floating parameter to {training_dtype} (engine.py:1851-1862), which would "
                    f"rewrite the {self.storage} bytes of the 4-bit weights: model.quantization.bnb_4bit_quant_storage "
                    f"must be uint8 or {training_dtype}")
        return None

    def to_json(self) -> str:
        """Canonical JSON (the model spec's ``quantization``)."""
        return json.dumps({"bnb_4bit_quant_type": self.quant_type, "bnb_4bit_use_double_quant": self.double_quant,
                           "bnb_4bit_compute_dtype": self.compute_dtype, "bnb_4bit_quant_storage": self.storage,
                           "llm_int8_skip_modules": list(self.skip_modules), "load_in_4bit": True},
                          sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> FourBitBase:
        """The base of :meth:`to_json`'s text."""
        data = json.loads(text)
        return FourBitBase(quant_type=data["bnb_4bit_quant_type"], double_quant=data["bnb_4bit_use_double_quant"],
                           compute_dtype=data["bnb_4bit_compute_dtype"], storage=data["bnb_4bit_quant_storage"],
                           skip_modules=tuple(data["llm_int8_skip_modules"]))


def bitsandbytes_missing() -> str | None:
    """Why no trial can quantize on this machine (bitsandbytes not installed), or None. The plan needs no
    bitsandbytes (transformers' rule and the bytes are pure); every candidate of a QLoRA study is invalid with this
    reason where it is missing, and nothing is launched."""
    try:
        metadata.version("bitsandbytes")
    except metadata.PackageNotFoundError:
        return "model.quantization needs the bitsandbytes package where trials run (pip install bitsandbytes)"
    return None


def _dtype(value: Any, choices: tuple[str, ...], what: str) -> str:
    text = str(value).removeprefix("torch.")
    if text not in choices:
        raise ValueError(f"{what} must be one of {', '.join(choices)}, got {value!r}")
    return text


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false, got {value!r}")
    return value


def _field(name: str, value: Any) -> Any:
    """The checked value of one field; ValueError naming the rule."""
    if name == "load_in_4bit":
        if value is not True:
            raise ValueError("dsopt plans 4-bit bases: load_in_4bit must be true")
        return True
    if name == "load_in_8bit":
        if value is not False:
            raise ValueError("an 8-bit base (LLM.int8) is not planned by dsopt yet: use load_in_4bit")
        return False
    if name == "bnb_4bit_quant_type":
        if value not in QUANT_TYPES:
            raise ValueError(f"must be one of {', '.join(QUANT_TYPES)}, got {value!r}")
        return value
    if name == "bnb_4bit_use_double_quant":
        return _bool(value, name)
    if name == "bnb_4bit_compute_dtype":
        return _dtype(value, COMPUTE_DTYPES, name)
    if name == "bnb_4bit_quant_storage":
        return _dtype(value, tuple(STORAGE_BYTES), name)
    if name == "llm_int8_skip_modules":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise ValueError(f"must be a list of module names, got {value!r}")
        return tuple(sorted(set(value)))
    if name == "llm_int8_threshold":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"must be a number, got {value!r}")
        return value
    if name == "llm_int8_has_fp16_weight":
        return _bool(value, name)
    if name == "quant_method":
        if value != "bitsandbytes":
            raise ValueError(f"dsopt plans bitsandbytes quantization (quant_method: bitsandbytes), got {value!r}")
        return value
    if name == "llm_int8_enable_fp32_cpu_offload":
        if _bool(value, name):
            raise ValueError("modules offloaded to the CPU by a device map are not planned: DeepSpeed places the "
                             "model (use offload_param under ZeRO-3)")
        return value
    raise AssertionError(name)


def parse_quantization(value: Any, *, source: str, key: str) -> str:
    """``model.quantization`` as canonical JSON (:meth:`FourBitBase.to_json`); UserError naming the field."""
    if not isinstance(value, Mapping):
        raise UserError(source=source, key=key, why="expected a mapping of BitsAndBytesConfig fields, e.g. "
                        "{load_in_4bit: true, bnb_4bit_quant_type: nf4, bnb_4bit_use_double_quant: true, "
                        "bnb_4bit_compute_dtype: bfloat16}")
    fields: dict[str, Any] = {}
    for raw_name, raw_value in value.items():
        name = str(raw_name)
        if name not in _PLANNED + _INERT:
            raise UserError(source=source, key=f"{key}.{name}", why="unknown BitsAndBytesConfig field; dsopt plans "
                            + ", ".join(_PLANNED))
        if raw_value is None:
            continue
        try:
            fields[name] = _field(name, raw_value)
        except ValueError as err:
            raise UserError(source=source, key=f"{key}.{name}", why=str(err)) from None
    if not fields.get("load_in_4bit"):
        raise UserError(source=source, key=f"{key}.load_in_4bit", why="required: true (dsopt plans 4-bit QLoRA "
                        "bases)")
    base = FourBitBase(quant_type=fields.get("bnb_4bit_quant_type", "fp4"),
                       double_quant=fields.get("bnb_4bit_use_double_quant", False),
                       compute_dtype=fields.get("bnb_4bit_compute_dtype", "float32"),
                       storage=fields.get("bnb_4bit_quant_storage", "uint8"),
                       skip_modules=fields.get("llm_int8_skip_modules", ()))
    return base.to_json()
