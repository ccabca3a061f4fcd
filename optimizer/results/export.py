"""Export a measured trial as a ready-to-use DeepSpeed JSON: the builder the trial used, DeepSpeed's parser,
an atomic write that never overwrites without ``force``.

``hf=True`` writes the Hugging Face Trainer variant: the batch sizes and the optimizer's hyper-parameters
become ``"auto"`` (the Trainer fills them from its ``TrainingArguments``: ``per_device_train_batch_size``,
``gradient_accumulation_steps``, ``learning_rate``, ``weight_decay``, ``adam_beta1/2``, ``adam_epsilon``);
ZeRO, offload and precision stay as measured — pass ``--bf16``/``--fp16`` to the Trainer to match.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from optimizer.deepspeed.config import build_ds_config
from optimizer.deepspeed.validate import InvalidDeepSpeedConfig, validate_with_deepspeed
from optimizer.study.errors import UserError
from optimizer.study.knobs import KNOB_NAMES, with_knobs
from optimizer.study.quantization_section import FourBitBase
from optimizer.study.specs import TransformerModel, baseline_candidate
from optimizer.study.study_file import StudySpec

HF_AUTO_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
HF_AUTO_OPTIMIZER = ("lr", "betas", "eps", "weight_decay")


def exported_config(*, spec: StudySpec, knobs: dict[str, Any], hf: bool) -> dict[str, Any]:
    """The DeepSpeed config of the measured candidate ``knobs``, validated by DeepSpeed's parser."""
    candidate = with_knobs(baseline_candidate(spec.training), {k: knobs[k] for k in KNOB_NAMES if k in knobs})
    config = build_ds_config(candidate=candidate, model=spec.model, hardware=spec.hardware, training=spec.training)
    try:
        validate_with_deepspeed(config, world_size=spec.hardware.world_size)
    except InvalidDeepSpeedConfig as err:
        raise UserError(source=str(spec.path), key="export", why=str(err)) from None
    return hf_auto(config) if hf else config


def hf_auto(config: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face variant of a DeepSpeed config: batch sizes and the optimizer's hyper-parameters ``"auto"``
    (module doc)."""
    auto = copy.deepcopy(config)
    for key in HF_AUTO_KEYS:
        auto[key] = "auto"
    for key in HF_AUTO_OPTIMIZER:
        auto["optimizer"]["params"][key] = "auto"
    return auto


CONSTRUCTION_ADVICE = {
    "zero_init": "build your model under deepspeed.zero.Init(config_dict_or_path=<this JSON>) — Hugging Face's "
                 "Trainer does this for you when TrainingArguments(deepspeed=...) exists before from_pretrained/"
                 "from_config (stage 3); the measured memory assumes no rank ever holds the whole model",
    "device": "build your model on its GPU in the training dtype (e.g. from_pretrained(..., dtype=torch.bfloat16) "
              "or `with torch.device('cuda')`), not in FP32 on the host; DeepSpeed makes the FP32 master weights",
    "full": "the measurement built the whole FP32 model on every rank's host, as a plain script does",
}
"""What each construction asks of the training script that uses an exported config."""


def construction_advice(*, spec: StudySpec, knobs: dict[str, Any]) -> str:
    """How the script must build the model for the exported config's measured memory to hold."""
    candidate = with_knobs(baseline_candidate(spec.training), {k: knobs[k] for k in KNOB_NAMES if k in knobs})
    construction = spec.training.construction(candidate.zero_stage)
    return f"model construction ({construction}, training.model_init={spec.training.model_init}): " \
        f"{CONSTRUCTION_ADVICE[construction.value]}"


def planned_setup(spec: StudySpec) -> str:
    """What the exported config was planned and measured for — what trains and what runs beside it — for the
    script to match: the memory holds for that setup only (a LoRA plan's config is not a full fine-tune's)."""
    model = spec.model
    parts: list[str] = []
    if isinstance(model, TransformerModel):
        if model.quantization is not None:
            base = FourBitBase.from_json(model.quantization)
            parts.append(f"a {base.label()} base: from_pretrained(..., quantization_config=BitsAndBytesConfig("
                         f"load_in_4bit=True, bnb_4bit_quant_type='{base.quant_type}', bnb_4bit_use_double_quant="
                         f"{base.double_quant}, bnb_4bit_compute_dtype=torch.{base.compute_dtype}, "
                         f"bnb_4bit_quant_storage=torch.{base.storage}), dtype=<the training dtype>)")
        if model.peft is not None:
            fields = json.loads(model.peft)
            shown = {k: fields[k] for k in ("r", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save",
                                             "bias", "use_dora") if k in fields}
            parts.append("PEFT LoRA " + ", ".join(f"{k}={v}" for k, v in shown.items())
                         + " (peft.get_peft_model(model, LoraConfig(...)) before DeepSpeed; only the adapters train)")
        if model.frozen:
            parts.append(f"frozen parameters {', '.join(model.frozen)} (requires_grad off before DeepSpeed)")
        if model.reference_model:
            parts.append("a frozen reference model " + ("(the base with the adapters disabled, no copy)"
                                                        if model.peft is not None else
                                                        "(a copy at ZeRO stage 0 unless 3, no optimizer: TRL's "
                                                        "prepare_deepspeed)"))
        if model.sequences_per_sample != 1:
            parts.append(f"{model.sequences_per_sample} sequences per sample (the engine sees "
                         f"{model.sequences_per_sample} × the micro-batch rows: a DPO pair's chosen and rejected)")
        if model.lm_head == "trl_fused":
            parts.append("TRL's fused LM head (add_fused_lm_head: log-probabilities in tiles, no logits)")
    return "planned for: " + ("; ".join(parts) if parts else "a full fine-tune (every parameter trains)")


def write_atomically(path: Path, text: str, *, force: bool) -> None:
    """Write ``text`` to ``path`` via a temporary file and a rename; refuse to overwrite unless ``force``."""
    if path.is_dir():
        raise UserError(source="--out", key=str(path), why="is a directory; give a file path")
    if path.exists() and not force:
        raise UserError(source="--out", key=str(path), why="exists; pass --force to overwrite")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as err:
        raise UserError(source="--out", key=str(path), why=f"cannot write there: {err.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; an exported config is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export_text(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2) + "\n"
