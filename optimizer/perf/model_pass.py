"""The study's own model, one forward and backward at its own width, timed by the probe against the time model's count
of that pass's work (pure): what the FLOP count leaves out of compute.

The probe's GEMM and attention figures (:mod:`optimizer.perf.probe_plan`) time the model's matmuls alone. A training
micro-step also runs what the time model's FLOPs do not count, all of it per token: norms, activations, residual
adds, rotary embeddings, the casts around a 4-bit base's matmuls, and PEFT's adapters, thin GEMMs of inner dimension
r that run far below a GEMM's rate (on this project's Xeon, AVX2 pins, one thread: a 64→8→64 LoRA target's forward
and backward at 256 tokens in bf16 at 2.7 GFLOP/s, against 5.4 for the model's own bf16 GEMMs). On
``grid-qlora-llama-cpu`` the time model priced the bf16 rows 20–35 % too fast for it and launched a bf16 candidate
at 74 % of the best first.

So the probe also times the pass itself — the study's model built as a trial builds it (PEFT, a 4-bit base, frozen
parameters; :func:`launchers.models.builtin.build_workload`), its parameters cast to 16 bits as DeepSpeed's engine
casts them (0.19 ``runtime/engine.py`` ``_cast_module_mixed_precision``: floating-point parameters only), then
``loss.backward()`` with autograd alone, no DeepSpeed — at each precision and micro-batch of the space, and once on
one sample of a few tokens (a DPO pair's two rows; :func:`intercept_tokens`): the *intercept*, the per-call cost of
every module's forward and backward that the engine's skeleton already counts (:mod:`optimizer.perf.skeleton`), and a
4-bit base's dequantization, once per matmul whatever the tokens (:mod:`optimizer.perf.four_bit_work`). Each
timing carries the time model's count of its work (:func:`pass_terms`); with p the seconds the probe's GEMM figures
give that work, the pass's factor is k = (t̂ − t̂₀) / (p − p₀) between the pass and the intercept, t̂ a least-squares
fit t = a + p + c·FLOPs over the precision's passes (:func:`optimizer.perf.probed_rates.pass_factors`): how much
longer than its GEMMs the pass's per-token work runs. The
time model scales a candidate's FLOPs by it (:attr:`optimizer.perf.rates.Rates.pass_factors`; the dequantization,
in pass and intercept alike, is not in the slope), and calibration keeps it as a shape, as it keeps the
per-micro-batch GEMM factors. A reference model's forward (DPO) and recomputed forwards are scaled by the same
factor, though the pass times neither: a forward's per-token work taken to run as the pass's does.

Recomputation stays on the engine's skeleton (:mod:`optimizer.perf.skeleton`). A pass with every block checkpointed,
less the plain one and the recomputed FLOPs, was tried (2026-12-07): on grid-llama-cpu's fp32 model it said 3.3–4.4 ms
more per micro-step where the grid's ZeRO-0 rows ran 6.6–11.2 ms slower with full checkpointing (the skeleton, under
DeepSpeed, 7.4–11.5 ms): ``torch.utils.checkpoint`` costs more inside DeepSpeed's engine than around autograd alone,
and the replay of that grid at 9 MB needed 13 launches, not 1.

Depth: at most :data:`~optimizer.perf.probe_plan.PASS_LAYERS` blocks, at the study's width and with its vocabulary and
head (Llama-3 70B's pass is two of its 80 blocks, ~1.7 B parameters, beside its 2.1 B of embeddings and head). The
factor is a ratio, so the fewer blocks stand for all of them; where the head's per-token work runs at another factor
than a block's, two blocks weigh the head more than the whole model does (a bias left: a third depth would separate
them, at one more pass).
"""

from __future__ import annotations

import json
from dataclasses import replace

from optimizer.perf.rates import COMPUTE_FEATURES, FEATURES
from optimizer.perf.skeleton import SKELETON_TOKENS
from optimizer.perf.throughput import work
from optimizer.study.hf_config import LAYER_KEYS
from optimizer.study.knobs import Candidate
from optimizer.study.specs import HardwareSpec, TrainingSpec, TransformerModel


def intercept_tokens(sequence_length: int) -> int:
    """Tokens of each of the intercept's rows: the skeleton's :data:`~optimizer.perf.skeleton.SKELETON_TOKENS`, fewer
    where the study's sequence is not four times longer (a pass of 16 tokens against an intercept of 16 has no
    slope)."""
    return max(1, min(SKELETON_TOKENS, sequence_length // 4))


def depth_model(model: TransformerModel, layers: int) -> TransformerModel:
    """``model`` with ``layers`` blocks, its width, vocabulary and head kept: the layer count set in its
    ``transformers`` config (each of :data:`optimizer.study.hf_config.LAYER_KEYS` it has, in the config and in its
    ``text_config``), and each list there of one entry per block (``layer_types``, Gemma 3n's
    ``activation_sparsity_pattern``) cut to the first ``layers``; counts of special blocks (DeepSeek's
    ``first_k_dense_replace``) are left as they are, so two blocks of such a model may all be of one kind. The
    parameter inventory and traced activations are dropped: they are the whole model's (the probe traces the shorter
    one again)."""
    config = None
    if model.hf_config is not None:
        settings = json.loads(model.hf_config)
        for section in (settings, settings.get("text_config")):
            if not isinstance(section, dict):
                continue
            for key in LAYER_KEYS:
                if isinstance(section.get(key), int) and not isinstance(section.get(key), bool):
                    section[key] = layers
            for key, value in list(section.items()):  # one entry per block: layer_types, Gemma 3n's sparsity pattern
                if isinstance(value, list) and len(value) == model.layers:
                    section[key] = value[:layers]
        config = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return replace(model, layers=layers, hf_config=config, inventory=None, traced_activations=())


def pass_terms(*, candidate: Candidate, model: TransformerModel, hardware: HardwareSpec, training: TrainingSpec,
               micro_batch: int, tokens: int) -> tuple[tuple[str, float], ...]:
    """The time model's count of one pass's work (:data:`~optimizer.perf.rates.COMPUTE_FEATURES`, the non-zero ones),
    for ``model`` (the shorter one, its inventory traced) in ``candidate``'s precision on ``micro_batch`` samples of
    ``tokens`` tokens: one micro-step of one rank (:func:`optimizer.perf.throughput.work`), its recomputation the
    candidate's (the probe passes none), with no reference forward (the pass runs the trained model's forward and
    backward alone)."""
    ranks = hardware.gpus_per_node
    one = replace(training, micro_batch_size=micro_batch, global_batch_size=micro_batch * ranks,
                  sequence_length=tokens)
    candidate = replace(candidate, micro_batch_size=micro_batch)
    job = work(candidate=candidate, model=replace(model, reference_model=False),
               hardware=replace(hardware, nodes=1), training=one)
    vector = dict(zip(FEATURES, job.vector(), strict=True))
    return tuple((name, float(vector[name])) for name in COMPUTE_FEATURES if vector[name])
