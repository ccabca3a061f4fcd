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
or none where the candidate launched is that reference's own (:func:`own_reference`): its run is the reference.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

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
    size: the model's dropout layers (``model.dropout``; for an ``hf_config`` model, any of its dropout
    probabilities above 0, :mod:`optimizer.study.hf_config`) or LoRA's ``lora_dropout`` above 0."""
    model = study.model
    if not isinstance(model, TransformerModel):
        return False
    lora_dropout = float(json.loads(model.peft).get("lora_dropout", 0.0) or 0.0) if model.peft else 0.0
    return model.dropout or lora_dropout > 0


def reference_name(study: StudySpec, micro_batch_size: int) -> str:
    """The file and folder name of the reference at ``micro_batch_size`` (module doc)."""
    same = micro_batch_size == study.training.micro_batch_size or not draws_random(study)
    return "reference" if same else f"reference-mbs{micro_batch_size}"


def at_micro_batch(study: StudySpec, micro_batch_size: int) -> StudySpec:
    """The study whose FP32 reference runs at ``micro_batch_size`` (the same global batch, data and seed)."""
    return dataclasses.replace(study, training=dataclasses.replace(study.training, micro_batch_size=micro_batch_size))


def losses_for(study: StudySpec, candidate: Candidate, losses: list[float] | None, *,
               gpus: Sequence[str] | None = None, say: Callable[[str], None] = lambda _text: None
               ) -> list[float] | None:
    """The reference losses ``candidate`` is judged against: ``losses`` (the study's reference) where its micro-batch
    is the reference's or training draws no random numbers, else the reference at its own micro-batch size, cached or
    launched now (module doc); None, said, where that reference fails (the fidelity is then unknown)."""
    k = candidate.micro_batch_size
    name = reference_name(study, k)
    if name == "reference":
        return losses
    at = at_micro_batch(study, k)
    if cached_reference_losses(at, name=name) is None:
        say(f"the FP32 reference at micro-batch {k}: the model draws dropout masks per micro-batch, so a candidate is "
            "judged against the reference of its own micro-batch size")
    try:
        return reference_losses(at, gpus=gpus, name=name)
    except ReferenceFailed as failed:
        say(f"{failed}; loss fidelity at micro-batch {k} is not computed")
        return None


def own_reference(study: StudySpec, candidate: Candidate) -> str | None:
    """The name of the reference ``candidate``'s own run would be — it is the FP32 reference of its micro-batch size,
    another than the study's, not yet cached — or None (then :func:`losses_for` judges it)."""
    name = reference_name(study, candidate.micro_batch_size)
    if name == "reference":
        return None
    at = at_micro_batch(study, candidate.micro_batch_size)
    if candidate != reference_candidate(at) or cached_reference_losses(at, name=name) is not None:
        return None
    return name


def kept_as_reference(study: StudySpec, candidate: Candidate, name: str, result: TrialResult) -> TrialResult:
    """``result`` of :func:`own_reference`'s candidate: where it trained, its losses cached as that reference and its
    fidelity 0 (the reference itself, as the study's own reference run is its candidate's trial)."""
    if result.outcome is not Outcome.OK or not result.losses:
        return result
    keep_reference(at_micro_batch(study, candidate.micro_batch_size), name=name, candidate=candidate,
                   losses=result.losses)
    return dataclasses.replace(result, loss_fidelity=0.0)
