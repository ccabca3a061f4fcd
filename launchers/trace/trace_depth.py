"""Traces of a deep model from two shallow copies of it, so a 70B model traces in seconds.

A decoder's activations are what lies outside the blocks (embeddings, final norm, logits, loss) plus what each
block keeps, and the blocks repeat: with checkpointing period P (1 for ``none``, ``full`` and ``selective``;
K for ``every_K``, whose blocks K, 2K, … are recomputed) every P more blocks add the same bytes at every moment
of the step. So every figure of one stretch of the step (forward; backward after k blocks' backward completed)
is linear in the depth L over depths of the same remainder mod P: traced at L₁ = 2P + r and L₂ = 3P + r
(r = L mod P; the last blocks, where backward starts, are then the same as the full model's), the figure at L
is ``f(L₁) + (f(L₂) − f(L₁))·(L − L₁)/P``. The high-water mark is the largest stretch's, extended stretch by
stretch, because across stretches the mark moves. Measured on gpt2-tiny (2 × 32 tokens): at depth 2 the
embedding's backward holds it, a moment that does not grow with depth; from depth 3 on the start of backward
does, one block's activations more per block; extending the overall mark from depths 2 and 3 was 3.7 % under
at depth 7, extending each stretch is exact.

A depth-dependent structure the copies would miss (dense first layers, MoE every other layer, a per-layer
list the copy cannot cut) shows as a parameter count that does not extend to the full model's: the model is
then traced at its full depth. Tested against full-depth traces (``tests/launchers/trace/test_trace_depth.py``).

The built-in GPT's depth is ``layers``; a transformers config's the first of :data:`LAYER_KEYS` equal to the
model's depth (in ``text_config`` when the model has one), with every per-layer list (a list of L entries,
e.g. ``layer_types``) cut to the copy's depth. An entry point's model is traced as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
"""Where transformers configs keep the depth (``n_layer``: GPT-2; ``num_layers``: some remote-code families)."""


def period(checkpointing: str) -> int:
    """Blocks after which the checkpointing pattern repeats."""
    return int(checkpointing.removeprefix("every_")) if checkpointing.startswith("every_") else 1


def shallow_depths(layers: int, checkpointing: str) -> tuple[int, int] | None:
    """(L₁, L₂) to trace instead of ``layers`` (module doc), or None when the model is no deeper than L₂."""
    p = period(checkpointing)
    first = 2 * p + layers % p
    return (first, first + p) if first + p < layers else None


def _hf_at_depth(config: dict[str, Any], full: int, layers: int) -> dict[str, Any] | None:
    for key in LAYER_KEYS:
        if config.get(key) == full and not isinstance(config.get(key), bool):
            return {k: (v[:layers] if isinstance(v, list) and len(v) == full else v)
                    for k, v in config.items()} | {key: layers}
    text = config.get("text_config")
    if isinstance(text, dict):
        inner = _hf_at_depth(text, full, layers)
        return None if inner is None else {**config, "text_config": inner}
    return None


def spec_at_depth(model_spec: dict[str, Any], layers: int) -> dict[str, Any] | None:
    """The model spec with ``layers`` blocks, or None when its depth cannot be set (an entry point)."""
    if model_spec.get("entry_point"):
        return None
    full = int(model_spec["layers"])
    if model_spec.get("hf_config"):
        config = _hf_at_depth(dict(model_spec["hf_config"]), full, layers)
        return None if config is None else {**model_spec, "layers": layers, "hf_config": config}
    return {**model_spec, "layers": layers}


def extrapolate(shallow: Any, deeper: Any, *, depths: tuple[int, int], layers: int) -> Any:
    """The trace of ``layers`` blocks from the traces at ``depths`` (module doc): every integer figure (and each
    op's kept bytes) extended linearly, the joint peaks (with gradients, with ZeRO-3's gathered parameters) by
    :func:`_segments`; the largest module, the phase and
    the notes are the deeper copy's."""
    (d1, d2) = depths
    steps = (layers - d1) / (d2 - d1)

    def line(a: int, b: int) -> int:
        return max(0, round(a + (b - a) * steps))

    working = _segments(tuple((w,) for w in shallow.working_segments),
                        tuple((w,) for w in deeper.working_segments), depths=depths, line=line)
    marks = [w for (w,) in working]
    split = {name: tuple(w for (w,) in _segments(tuple((w,) for w in getattr(shallow, name)),
                                                 tuple((w,) for w in getattr(deeper, name)), depths=depths, line=line))
             for name in ("ungraded_segments", "graded_segments")}
    out: dict[str, Any] = {
        "joint_segments": _segments(shallow.joint_segments, deeper.joint_segments, depths=depths, line=line),
        "working_segments": tuple(marks), "activation_peak_bytes": max(marks), **split,
        "peak_phase": "forward" if marks[0] == max(marks) else "backward"}
    if shallow.zero3_joint_segments and deeper.zero3_joint_segments:
        # activations and gathered parameters extended as the rest; the coalesced buffers (a few prefetch buckets,
        # bounded by the bucket size, not the depth) are the deeper copy's
        pairs = _segments(tuple(s[:2] for s in shallow.zero3_joint_segments),
                          tuple(s[:2] for s in deeper.zero3_joint_segments), depths=depths, line=line)
        kept = _segments(tuple(s[2:3] for s in shallow.zero3_joint_segments),
                         tuple(s[2:3] for s in deeper.zero3_joint_segments), depths=depths, line=lambda _, b: b)
        # autograd's copies (4-bit weights kept past their release) grow with the depth: extended as the rest
        copies = _segments(tuple(s[3:] for s in shallow.zero3_joint_segments),
                           tuple(s[3:] for s in deeper.zero3_joint_segments), depths=depths, line=line)
        out["zero3_joint_segments"] = tuple((*pair, *buffers, *extra)
                                            for pair, buffers, extra in zip(pairs, kept, copies, strict=True))
    # A reference copy's hold does not extend on a line: its prefetch front gains entries block by block with a
    # period of its own (the tiny Qwen2: 488,704 / 510,336 / 669,952 / 691,584 bytes at 2/3/4/5 blocks, fp32), and
    # the moment everything peaks moves between the copies — extended from 2 and 3 blocks it read +31…+55 % or
    # −3 % against 8- and 12-block traces. So an extended trace has none, and the ledger books the formula.
    out["zero3_reference_joint"] = ()
    for field in dataclasses.fields(deeper):
        a, b = getattr(shallow, field.name), getattr(deeper, field.name)
        if field.name in out:
            continue
        if field.name == "largest_module_parameters" or isinstance(b, (str, tuple)):
            out[field.name] = b
        elif isinstance(b, dict):
            keys = dict.fromkeys([*b, *a])
            out[field.name] = dict(sorted(((k, line(a.get(k, 0), b.get(k, 0))) for k in keys), key=lambda kv: -kv[1]))
        else:
            out[field.name] = line(int(a), int(b))
    note = f"traced at depths {d1} and {d2} and extended linearly to {layers} blocks"
    out["notes"] = (*deeper.notes, note)
    return type(deeper)(**out)


def _segments(shallow: tuple[tuple[int, ...], ...], deeper: tuple[tuple[int, ...], ...], *,
              depths: tuple[int, int], line: Callable[[int, int], int]) -> tuple[tuple[int, ...], ...]:
    """Per-stretch figures (:class:`launchers.trace.tracer.TraceResult`'s ``joint_segments``, ``working_segments``) of
    forward and of the first and last P + 1 stretches of backward (after 0…P and after L−P…L blocks), each
    extended linearly: every moment of one stretch grows alike with the depth, and the stretches between
    repeat with period P, so on a line in the block count their maximum is within the first or last period."""
    p = depths[1] - depths[0]
    zero = tuple(0 for _ in (shallow or deeper)[0])
    a = [*shallow, *[zero] * (depths[0] + 2 - len(shallow))]
    b = [*deeper, *[zero] * (depths[1] + 2 - len(deeper))]
    picks = [0, *range(1, p + 2)]  # forward; after 0..P blocks
    out = [tuple(line(x, y) for x, y in zip(a[i], b[i], strict=True)) for i in picks]
    out += [tuple(line(x, y) for x, y in zip(a[-1 - j], b[-1 - j], strict=True)) for j in range(p, -1, -1)]
    return tuple(out)


def shallow_specs(model_spec: dict[str, Any], checkpointing: str,
                  parameters: int | None) -> tuple[tuple[int, int], list[dict[str, Any]]] | None:
    """The depths and specs of the two shallow copies to trace, or None to trace the model whole (it is not
    deep enough, its depth cannot be set, or ``parameters`` — the full model's trainable count, as a trace counts
    them, to check the copies against — is unknown)."""
    depths = shallow_depths(int(model_spec["layers"]), checkpointing)
    if depths is None or parameters is None:
        return None
    specs = [spec_at_depth(model_spec, depth) for depth in depths]
    return None if any(spec is None for spec in specs) else (depths, specs)  # type: ignore[return-value]


def from_copies(shallow: Any, deeper: Any, *, depths: tuple[int, int], layers: int, parameters: int | None) -> Any:
    """The whole model's trace from its two shallow copies' (:func:`shallow_specs`): a copy's failure as it is (the
    op fails at any depth), else :func:`extrapolate`'s — or None when that does not extend to ``parameters`` (a
    structure the copies miss: trace the model at its full depth)."""
    for result in (shallow, deeper):
        if not hasattr(result, "parameters"):
            return result
    whole = extrapolate(shallow, deeper, depths=depths, layers=layers)
    return whole if whole.parameters == parameters else None


def trace_by_depth(run: Callable[[dict[str, Any]], Any], *, model_spec: dict[str, Any], checkpointing: str,
                   parameters: int | None) -> Any:
    """``run(spec)`` (a trace or a failure) for the model of ``model_spec``: from two shallow copies when that
    is possible and their parameter counts extend to ``parameters`` (:func:`shallow_specs`, :func:`from_copies`),
    else at full depth."""
    chosen = shallow_specs(model_spec, checkpointing, parameters)
    if chosen is None:
        return run(model_spec)
    depths, specs = chosen
    shallow, deeper = (run(spec) for spec in specs)
    whole = from_copies(shallow, deeper, depths=depths, layers=int(model_spec["layers"]), parameters=parameters)
    return run(model_spec) if whole is None else whole
