"""The FP32 reference a candidate's losses are judged against: the study's, or one at the candidate's micro-batch
size where training draws random numbers.

Dropout draws its masks for a whole micro-batch tensor at once, from one generator, layer after layer
(``torch.nn.functional.dropout`` → ``aten::native_dropout`` → ``bernoulli_``), so the masks a sample gets depend on
how its global batch is cut into micro-batches: at micro-batch 1 the first layer's masks of the second sample are
drawn after every layer's masks of the first, at micro-batch 2 right after the first layer's. The same data and
weights then see other masks, and the losses part by the masks' noise, not by any numerical difference — measured on
transformers' GPT-2 (its default ``resid_pdrop``/``embd_pdrop``/``attn_pdrop`` 0.1, LoRA, 2 CPU ranks, fp32 ZeRO-0):
1.4e-3 to 1.8e-3 relative at micro-batch 1 and 4 against the reference's 2, over fp32's 1e-4 tolerance, while with
the dropouts at 0 the same comparison gave 8.6e-8. ZeRO stages, offload, precision and (with
``torch.utils.checkpoint``'s default ``preserve_rng_state``) recomputation draw the same masks in the same order:
at the reference's micro-batch the grid's fp32 candidates agreed to 0.0. So where the model draws random numbers
in training, a candidate is judged against an FP32 reference at its own micro-batch size — one more reference launch
per micro-batch size the study launches, cached as ``reference-mbs<k>.json`` beside the study's ``reference.json`` —
or none where the candidate launched is that reference's own (:attr:`Judge.own`): its run is the reference.
:func:`judge_for` decides which, once per launch, for ``dsopt study run``, ``dsopt trial`` and
``benchmarks/record_grid.py`` alike.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from launchers.trial.run import (
    ReferenceFailed,
    cached_reference_losses,
    keep_reference,
    reference_candidate,
    reference_losses,
)
from optimizer.results.trial_result import Outcome, TrialResult
from optimizer.study.knobs import Candidate
from optimizer.study.specs import TransformerModel
from optimizer.study.study_file import StudySpec


def draws_random(study: StudySpec) -> bool:
    """Whether the study's training draws random numbers whose assignment to samples depends on the micro-batch
    size: as the study says — the model's dropout layers (``model.dropout``; for an ``hf_config`` model, any of its
    dropout probabilities above 0, :mod:`optimizer.study.hf_config`) or LoRA's ``lora_dropout`` above 0 — or as its
    FP32 reference run measured (:func:`reference_drew`: a script's or an entry point's model with dropout the model
    section does not say)."""
    model = study.model
    if not isinstance(model, TransformerModel):
        return False
    lora_dropout = float(json.loads(model.peft).get("lora_dropout", 0.0) or 0.0) if model.peft else 0.0
    return model.dropout or lora_dropout > 0 or reference_drew(study)


def reference_drew(study: StudySpec) -> bool:
    """Whether the study's FP32 reference — the one cached for the study as it is now, launched as the reference or
    kept from its own candidate's trial — drew random numbers while it trained (``draws_random`` in
    ``reference.json``, any rank's, :mod:`launchers.measure.rng_draws`); False before it has run."""
    try:
        data = json.loads((study.output_dir / "reference.json").read_text())
    except (OSError, ValueError):
        return False
    return cached_reference_losses(study) is not None and isinstance(data, dict) and data.get("draws_random") is True


def reference_name(study: StudySpec, micro_batch_size: int) -> str:
    """The file and folder name of the reference at ``micro_batch_size`` (module doc)."""
    same = micro_batch_size == study.training.micro_batch_size or not draws_random(study)
    return "reference" if same else f"reference-mbs{micro_batch_size}"


def at_micro_batch(study: StudySpec, micro_batch_size: int) -> StudySpec:
    """The study whose FP32 reference runs at ``micro_batch_size`` (the same global batch, data and seed)."""
    return dataclasses.replace(study, training=dataclasses.replace(study.training, micro_batch_size=micro_batch_size))


@dataclass(frozen=True, slots=True)
class Judge:
    """The FP32 reference a candidate is judged against, decided once per launch (:func:`judge_for`)."""

    name: str
    """Its file and folder under the study's output: ``reference``, or ``reference-mbs<k>`` (module doc)."""
    study: StudySpec
    """The study whose FP32 reference it is: the study itself, or the study at the candidate's micro-batch size."""
    own: bool
    """The candidate is that reference's own candidate and the reference is not cached yet: the candidate's run is
    the reference (:func:`kept_as_reference`), judged by nothing else."""
    launches: int = 0
    """FP32 reference launches judging the candidate takes: 1 where the reference at its micro-batch size is neither
    cached nor the candidate's own run (:func:`losses_for` launches it), else 0."""


def judge_for(study: StudySpec, candidate: Candidate, *, study_reference_held: bool = True) -> Judge:
    """The reference ``candidate`` is judged against (module doc): the study's where its micro-batch is the
    reference's or training draws no random numbers, else the one at its own micro-batch size.
    ``study_reference_held``: the caller holds the study's own reference losses — a study ran it (or was given it)
    in its setup, before any candidate, as ``record_grid.py`` does — so a candidate is never that reference's own;
    ``dsopt trial`` holds none, and the reference's own candidate is then the reference."""
    name = reference_name(study, candidate.micro_batch_size)
    at = study if name == "reference" else at_micro_batch(study, candidate.micro_batch_size)
    held = study_reference_held and name == "reference"
    missing = not held and cached_reference_losses(at, name=name) is None
    own = missing and candidate == reference_candidate(at)
    return Judge(name=name, study=at, own=own, launches=int(name != "reference" and missing and not own))


def losses_for(judge: Judge, losses: list[float] | None, *, gpus: Sequence[str] | None = None,
               say: Callable[[str], None] = lambda _text: None) -> list[float] | None:
    """The reference losses a candidate with this ``judge`` is judged against: ``losses`` (the study's reference,
    which the caller has) where it is the study's, else the reference at the candidate's micro-batch size, cached or
    launched now; None, said, where that reference fails (the fidelity is then unknown)."""
    if judge.name == "reference":
        return losses
    k = judge.study.training.micro_batch_size
    if cached_reference_losses(judge.study, name=judge.name) is None:
        say(f"the FP32 reference at micro-batch {k}: the model draws dropout masks per micro-batch, so a candidate is "
            "judged against the reference of its own micro-batch size")
    try:
        return reference_losses(judge.study, gpus=gpus, name=judge.name)
    except ReferenceFailed as failed:
        say(f"{failed}; loss fidelity at micro-batch {k} is not computed")
        return None


def kept_as_reference(judge: Judge, candidate: Candidate, result: TrialResult) -> TrialResult:
    """``result`` of a candidate that is its ``judge``'s own (:attr:`Judge.own`): where it trained, its losses cached
    as that reference and its fidelity 0 (the reference itself, as the study's own reference run is its candidate's
    trial)."""
    if not judge.own or result.outcome is not Outcome.OK or not result.losses:
        return result
    keep_reference(judge.study, name=judge.name, candidate=candidate, losses=result.losses, drew=result.draws_random)
    return dataclasses.replace(result, loss_fidelity=0.0)
