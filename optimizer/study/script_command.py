"""``trial.command``: the user's own training script as the trial — its placeholders, the rule that every searched
knob reaches the script, and the command line of one candidate (pure).

The command is a list of strings, e.g. ``["python", "train.py", "--deepspeed", "{ds_config}"]``, run on every rank
by torchrun (``launchers/trial/run.py``). ``{name}`` is a placeholder (:data:`PLACEHOLDERS`); ``{{`` and ``}}`` are
literal braces. ``{ds_config}`` must appear: it is how the candidate reaches the script.

Which knobs need a placeholder (:func:`uncovered_knobs`): ZeRO stage and offload are always in the DeepSpeed JSON;
checkpointing never is (a script turns recomputation on itself: ``gradient_checkpointing_enable()``,
``torch.utils.checkpoint``); micro-batch, accumulation and precision are in the JSON of ``ds_config_style: plain``
but ``"auto"`` or checked against the script's own arguments in ``hf`` (the HF Trainer fills ``auto`` from
``--per_device_train_batch_size``/``--gradient_accumulation_steps`` and refuses a ``bf16.enabled`` that its
``--bf16`` contradicts: transformers/integrations/deepspeed.py ``trainer_config_process``/``fill_match``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from optimizer.study.knobs import Candidate, FullCheckpointing, NoCheckpointing, Precision

PLACEHOLDERS: dict[str, str] = {
    "ds_config": "the candidate's DeepSpeed JSON file (required)",
    "trial_dir": "the trial's folder (for the script's outputs)",
    "micro_batch_size": "the candidate's micro-batch per rank",
    "gradient_accumulation_steps": "micro-batches per optimizer step (global batch / (micro-batch x ranks))",
    "global_batch_size": "samples per optimizer step over all ranks",
    "precision": "fp32, bf16 or fp16",
    "bf16": "true when the candidate trains in bf16, else false",
    "fp16": "true when the candidate trains in fp16, else false",
    "zero_stage": "0, 1, 2 or 3",
    "checkpointing": "none, full, selective or every_K",
    "gradient_checkpointing": "true when the candidate recomputes activations, else false",
    "seed": "the trial's seed (trial.seed)",
    "max_steps": "optimizer steps the script should be ready to run (warm-up + measured + fp16 skips + 1)",
    "sequence_length": "training.sequence_length",
}
"""Every placeholder a command may hold, and what it becomes."""
STYLES = ("plain", "hf")
"""``trial.ds_config_style``: every value written, or the ``dsopt export --hf`` form ("auto" batch sizes)."""
_FIELD = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")


@dataclass(frozen=True, kw_only=True, slots=True)
class ScriptCommand:
    """The study's ``trial.command`` and how its DeepSpeed JSON is written."""

    argv: tuple[str, ...]
    """The command with its placeholders."""
    ds_config_style: str = "plain"
    """``plain`` or ``hf`` (:data:`STYLES`)."""
    tokens_per_sample: int | None = None
    """Tokens one sample carries, where the hook cannot read them from the batch (default: the sequence length)."""

    def __post_init__(self) -> None:
        if not self.argv or not all(isinstance(a, str) and a for a in self.argv):
            raise ValueError("command must be a non-empty list of non-empty strings, e.g. "
                             "['python', 'train.py', '--deepspeed', '{ds_config}']")
        if self.ds_config_style not in STYLES:
            raise ValueError(f"ds_config_style must be one of {', '.join(STYLES)}, got {self.ds_config_style!r}")
        names = placeholders(self.argv)
        if "ds_config" not in names:
            raise ValueError("command must pass {ds_config} (the candidate's DeepSpeed JSON) to the script")

    @property
    def names(self) -> frozenset[str]:
        """The placeholders the command holds."""
        return placeholders(self.argv)

    @property
    def script(self) -> str | None:
        """The Python file the command runs (``python X.py …`` or ``X.py …``), relative to the study file's folder;
        None for another program or a name built from placeholders."""
        argv = self.argv
        name = argv[1] if len(argv) > 1 and argv[0].rsplit("/", 1)[-1].startswith("python") else argv[0]
        return name if name.endswith(".py") and "{" not in name else None


def placeholders(argv: Sequence[str]) -> frozenset[str]:
    """The placeholder names in ``argv``; ValueError for an unknown one or a stray brace."""
    found = set()
    for arg in argv:
        for match in _FIELD.finditer(arg):
            text = match.group(0)
            if text in ("{{", "}}"):
                continue
            name = match.group(1)
            if name is None:
                raise ValueError(f"command argument {arg!r}: a lone {text!r} (write {text * 2} for a literal brace)")
            if name not in PLACEHOLDERS:
                raise ValueError(f"command argument {arg!r}: unknown placeholder {{{name}}}; known: "
                                 + ", ".join(f"{{{k}}}" for k in PLACEHOLDERS))
            found.add(name)
    return frozenset(found)


def uncovered_knobs(command: ScriptCommand, searched: Mapping[str, Sequence[str]]) -> list[str]:
    """The searched knobs (``searched``: knob → its values, more than one) that cannot reach the script, each with
    what would carry it (module doc)."""
    names = command.names
    missing = []
    if "checkpointing" in searched and "checkpointing" not in names:
        binary = set(searched["checkpointing"]) <= {str(NoCheckpointing()), str(FullCheckpointing())}
        if "gradient_checkpointing" not in names or not binary:
            carry = "{checkpointing}" if not binary else "{checkpointing} or {gradient_checkpointing}"
            missing.append(f"checkpointing (searched: {', '.join(searched['checkpointing'])}) needs {carry}: "
                           "recomputation is the script's to turn on, not DeepSpeed's JSON's")
    if command.ds_config_style == "hf":
        if "micro_batch_size" in searched:
            missing += [f"micro_batch_size (searched) needs {{{n}}} in an hf-style command: its JSON says 'auto'"
                        for n in ("micro_batch_size", "gradient_accumulation_steps") if n not in names]
        if "precision" in searched and "precision" not in names:
            missing += [f"precision (searched: {', '.join(searched['precision'])}) needs {{precision}} or {{{p}}} "
                        "in an hf-style command: the HF Trainer checks bf16/fp16 against its own arguments"
                        for p in searched["precision"] if p != str(Precision.FP32) and p not in names]
    return missing


def substitute(argv: Sequence[str], values: Mapping[str, str]) -> tuple[str, ...]:
    """``argv`` with every placeholder replaced by ``values`` (:func:`command_values`) and ``{{``/``}}`` unescaped."""
    def one(match: re.Match[str]) -> str:
        text = match.group(0)
        return text[0] if text in ("{{", "}}") else values[match.group(1)]

    return tuple(_FIELD.sub(one, arg) for arg in argv)


def command_values(*, candidate: Candidate, ds_config: str, trial_dir: str, global_batch_size: int, world_size: int,
                   seed: int, max_steps: int, sequence_length: int) -> dict[str, str]:
    """What each placeholder becomes for ``candidate``."""
    micro = candidate.micro_batch_size
    return {
        "ds_config": ds_config, "trial_dir": trial_dir, "micro_batch_size": str(micro),
        "gradient_accumulation_steps": str(global_batch_size // (micro * world_size)),
        "global_batch_size": str(global_batch_size), "precision": str(candidate.precision),
        "bf16": _flag(candidate.precision is Precision.BF16), "fp16": _flag(candidate.precision is Precision.FP16),
        "zero_stage": str(int(candidate.zero_stage)), "checkpointing": str(candidate.checkpointing),
        "gradient_checkpointing": _flag(not isinstance(candidate.checkpointing, NoCheckpointing)),
        "seed": str(seed), "max_steps": str(max_steps), "sequence_length": str(sequence_length),
    }


def _flag(on: bool) -> str:
    return "true" if on else "false"


def exported_command(command: ScriptCommand, *, candidate: Candidate, ds_config: str, global_batch_size: int,
                     world_size: int, seed: int, sequence_length: int) -> tuple[str, ...]:
    """The command line that trains with an exported config: the candidate's values, ``ds_config`` the exported
    file; ``{trial_dir}`` and ``{max_steps}``, which only a trial fixes, left for the user to fill."""
    values = command_values(candidate=candidate, ds_config=ds_config, trial_dir="{trial_dir}",
                            global_batch_size=global_batch_size, world_size=world_size, seed=seed, max_steps=0,
                            sequence_length=sequence_length)
    return substitute(command.argv, {**values, "max_steps": "{max_steps}"})
