"""The ledger's init phase: what one rank holds while the model is built and ``deepspeed.initialize`` runs (pure).

Init is a sequence of moments; the ledger's ``init`` items are, per memory, those of the moment that holds
the most there (GPU and host peak at different moments on CUDA; on CPU ranks, one memory, the moment with
the largest total). Each moment follows the trial's construction (:class:`~optimizer.study.specs.Construction`,
from ``training.model_init``) and DeepSpeed 0.19.8's set-up code; symbols are :mod:`optimizer.ledger.model_states`'
(Ψ, N, g, P, Q, S, Lₜ, LL, B) plus Ψ₁₂ = Ψ padded to 2N:

* **construction** — ``full``: the FP32 model on the host, 4Ψ, then cast parameter by parameter to the training
  dtype (+g·Lₜ, ``engine.py:1859-1862``) and moved to the device (g·Ψ there, ``engine.py:2092-2094``);
  ``device``: g·Ψ on the device; ``zero_init``: the partition g·Q where ``offload_param`` puts it, plus the
  largest module whole on the device before its ``_post_init_method`` partitions it
  (``partition_parameters.py:1232-1262``) and, for the seeded initialisation that follows (as transformers'
  ``initialize_weights_zero3``), gathered with its all-gather buffer: 2·g·LL.
* **stage 0** — FP32: the model as built. 16-bit: ``FP16_Optimizer`` flattens (g·Ψ), makes the FP32 master (4Ψ) and
  runs one step on zero FP32 gradients (4Ψ) so Adam's states exist (8Ψ) (``fused_optimizer.py:88-130``).
* **stages 1–2** — flattening: the parameters and their flat copy, g·Ψ + g·Ψ₁₂, on the device when it has room
  for the copy (device memory − reserve − g·Ψ ≥ g·Ψ₁₂), else on the host with only the flat copy moved over
  (``stage_1_and_2.py:438-525``); then the FP32 master partition 4P and a zero FP32 gradient partition 4P
  (``:560``, ``initialize_optimizer_states`` ``:934-952``), on the host with ``offload_optimizer`` (plus the g·P
  staging partition and 2·g·Lₜ buffers).
* **stage 3** — a model that arrives whole (``device``/``full``) is partitioned on the device (g·Ψ + g·Lₜ); then
  two moments: the partition and its defragmented flat copy (2·g·Q: ``defragment`` copies the partitions to a
  host buffer and back, ``runtime/zero/utils.py:215-243``, so on a GPU the copy is on the host; with
  ``offload_param`` both are pinned host memory, ``stage3.py:975-995``) beside the FP32 master 4Q
  (``:1157-1172``), the gradient bucket g·B (``:779-784``) and the gathered largest module (2·g·LL); and the
  flat partition, the master and the zero FP32 gradient sub-group 4S of ``initialize_optimizer_states``
  (``:1301-1344``), on the host when the optimizer is offloaded (``self.device``, ``:333``). With CPU
  optimizer offload each sub-group's gradient is also zeroed, pinned and kept (4Q in all, ``:1337-1342``);
  on CUDA the pinning copies one sub-group (+4S, ``accelerator/abstract_accelerator.py:335-339``), on CPU
  ranks ``pin_memory`` returns the tensor itself (``accelerator/cpu_accelerator.py:283-292``).

Checked against the init-phase peak of real 2-rank CPU runs (``tests/real/deepspeed/test_init_real.py``). Adam's
states are created lazily at the first step at stages 1–3 (torch/DeepSpeed Adam), so they are not here.
"""

from __future__ import annotations

from collections.abc import Sequence

from optimizer.deepspeed.versions import LEDGER_DEEPSPEED_VERSION
from optimizer.deepspeed.zero_settings import (
    DEEPSPEED_PARAM_MAX_IN_CPU,
    DEEPSPEED_PARAM_SWAP_BUFFER_ELEMENTS,
    DEEPSPEED_PARAM_SWAP_BUFFERS,
)
from optimizer.ledger.items import Category, LedgerItem, Location, Phase
from optimizer.study.knobs import Candidate, OffloadDevice, Precision, ZeroStage
from optimizer.study.specs import Construction

DS = f"DeepSpeed {LEDGER_DEEPSPEED_VERSION}"
FP32 = 4
Moment = list[LedgerItem]


def _item(name: str, category: Category, location: Location, num_bytes: int, formula: str,
          source: str) -> LedgerItem:
    return LedgerItem(name=name, category=category, location=location, bytes=num_bytes, formula=formula,
                      source=source, phase=Phase.INIT)


def _place(device: OffloadDevice) -> Location:
    return Location.GPU if device is OffloadDevice.NONE else Location.HOST


def parameter_location(offload_param: OffloadDevice) -> Location:
    """Where ZeRO-3 keeps the parameter partition: the device, pinned host RAM, or NVMe files."""
    return {OffloadDevice.NONE: Location.GPU, OffloadDevice.CPU: Location.HOST,
            OffloadDevice.NVME: Location.NVME}[offload_param]


def construction_moments(*, construction: Construction, precision: Precision, g: int, psi: int, q: int,
                         largest_module: int, param_place: Location,
                         tied: int = 0, four_bit: int = 0, four_bit_bytes: int = 0) -> list[Moment]:
    """The moments of building the model, before DeepSpeed sees it. ``tied``: elements of the tensors a tied
    weight's other modules hold until the tie replaces them
    (:func:`optimizer.ledger.transformer.tied_copy_elements`). ``four_bit`` elements of a QLoRA base held in
    ``four_bit_bytes`` instead (transformers quantizes each weight as it loads it: ``quantizers/quantizer_bnb_4bit.py``
    ``create_quantized_param``)."""
    if construction is Construction.FULL:
        return [[_item("model built in fp32 on the host", Category.PARAMS, Location.HOST, FP32 * psi, "4Ψ",
                       "a script that builds the model whole (training.model_init: full)"),
                 *_untied(FP32, tied, Location.HOST)]]
    if construction is Construction.DEVICE:
        if four_bit:
            return [[_item(f"whole model on the device: {precision} layers + 4-bit weights", Category.PARAMS,
                           Location.GPU, g * (psi - four_bit) + four_bit_bytes, f"{g}(Ψ − Ψ₄) + 4-bit bytes",
                           "transformers from_pretrained(quantization_config=...) (quantized as loaded)"),
                     *_untied(g, tied, Location.GPU)]]
        return [[_item(f"whole model built on the device in {precision}", Category.PARAMS, Location.GPU, g * psi,
                       f"{g}Ψ", "training.model_init: device (torch.device + default dtype)"),
                 *_untied(g, tied, Location.GPU)]]
    return [[
        _item(f"{precision} parameter partition, made as modules are built", Category.PARAMS, param_place,
              g * q, f"{g}Q", f"{DS} partition_parameters.py:1232-1262, 1836"),
        _item("largest module whole before partitioning, then gathered to initialise", Category.PARAMS,
              Location.GPU, 2 * g * largest_module, f"2·{g}·LL",
              f"{DS} partition_parameters.py:1232-1262; GatheredParameters (all-gather buffer + gathered)"),
    ]]


def _untied(element_bytes: int, tied: int, location: Location) -> list[LedgerItem]:
    """The head a tied model is built with before it is tied (empty when nothing is tied)."""
    if not tied:
        return []
    return [_item("tied weight's own copy until it is tied", Category.PARAMS, location, element_bytes * tied,
                  f"{element_bytes}·T", "transformers 5.24 modeling_utils.py:2624 tie_weights (built, then tied)")]


def init_moments(*, candidate: Candidate, construction: Construction, psi: int, padded: int, p: int,
                 q: int, s: int, largest_tensor: int, largest_module: int, bucket: int,
                 device_bytes: int | None, tied: int = 0, trainable: int | None = None,
                 q_trainable: int | None = None, largest_cast: int | None = None, four_bit: int = 0,
                 four_bit_bytes: int = 0) -> list[Moment]:
    """Every moment of the init phase of ``candidate`` built by ``construction`` (bytes per rank).

    ``device_bytes``: the device memory DeepSpeed may use (capacity − reserve), for its "is there room to
    flatten on the device" test at stages 1–2; None on CPU ranks, where the test reads free host RAM.
    Where part of the model is frozen: ``trainable`` (Ψtr; ``padded``, ``p`` and ``s`` are then over the trainable
    tensors, ``largest_tensor`` the largest trainable one), ``q_trainable`` (Qtr) and ``largest_cast`` (the largest
    tensor of all, cast one by one); each defaults to the full fine-tune's figure. A QLoRA base: ``four_bit``
    elements of the frozen ones are 4-bit weights held in ``four_bit_bytes`` (packed + statistics), never cast."""
    t = psi if trainable is None else trainable
    qt = q if q_trainable is None else q_trainable
    cast = largest_tensor if largest_cast is None else largest_cast
    sym, qsym = ("Ψ", "Q") if t == psi else ("Ψtr", "Qtr")
    precision = candidate.precision
    g = precision.bytes_per_element
    stage = candidate.zero_stage
    opt_place = _place(candidate.offload_optimizer)
    param_place = parameter_location(candidate.offload_param)
    moments = construction_moments(construction=construction, precision=precision, g=g, psi=psi, q=q,
                                   largest_module=largest_module,
                                   param_place=param_place, tied=tied, four_bit=four_bit,
                                   four_bit_bytes=four_bit_bytes)
    frozen_bytes = g * (psi - t - four_bit) + four_bit_bytes
    frozen_formula = f"{g}(Ψ − Ψtr − Ψ₄) + 4-bit bytes" if four_bit else f"{g}(Ψ − Ψtr)"
    if construction is Construction.FULL:  # deepspeed.initialize casts parameter by parameter, then moves them
        fp32_model = _item("model built in fp32 on the host", Category.PARAMS, Location.HOST, FP32 * psi, "4Ψ",
                           "a script that builds the model whole (training.model_init: full)")
        if precision is not Precision.FP32:
            moments.append([fp32_model, _item(f"{precision} copy of one tensor while casting", Category.PARAMS,
                                              Location.HOST, g * cast, f"{g}Lₜ",
                                              f"{DS} engine.py:1859-1862 (param by param)")])
        moments.append([_item(f"whole {precision} model moved to the device", Category.PARAMS, Location.GPU,
                              g * psi, f"{g}Ψ", f"{DS} engine.py:2092-2094")])
    if stage is ZeroStage.DISABLED:
        if precision is not Precision.FP32:
            frozen = [_item(f"frozen {precision} parameters", Category.PARAMS, Location.GPU, frozen_bytes,
                            frozen_formula, f"{DS} engine.py:1851-1862 (the whole module cast)")] if t < psi else []
            moments.append([
                _item(f"{precision} parameters (flat)", Category.PARAMS, Location.GPU, g * t, f"{g}{sym}",
                      f"{DS} runtime/fp16/fused_optimizer.py:93-98"),
                *frozen,
                _item("fp32 master weights (flat)", Category.MASTER_WEIGHTS, Location.GPU, FP32 * t, f"4{sym}",
                      f"{DS} runtime/fp16/fused_optimizer.py:100"),
                _item("zero fp32 gradients for the initial step", Category.GRADS, Location.GPU, FP32 * t, f"4{sym}",
                      f"{DS} runtime/fp16/fused_optimizer.py:125-130"),
                _item("Adam exp_avg + exp_avg_sq (fp32)", Category.OPTIMIZER, Location.GPU, 8 * t, f"8{sym}",
                      f"{DS} runtime/fp16/fused_optimizer.py:130 (optimizer.step())"),
            ])
        return moments
    if stage in (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS):
        src = f"{DS} runtime/zero/stage_1_and_2.py"
        room = device_bytes is None or device_bytes - frozen_bytes - g * t >= g * padded  # :441-451
        where = Location.GPU if room else Location.HOST
        frozen = [_item(f"frozen {precision} parameters (whole on every rank)", Category.PARAMS, Location.GPU,
                        frozen_bytes, frozen_formula, f"{src}:428-434; {DS} engine.py:2093")] if t < psi else []
        moments.append([
            _item(f"{precision} parameters as built{'' if room else ', moved to the host'}", Category.PARAMS,
                  where, g * t, f"{g}{sym}", f"{src}:438-460"),
            *frozen,
            _item(f"{precision} flat copy (padded to 2N){'' if room else ', made on the host'}", Category.PARAMS,
                  where, g * padded, f"{g}Ψ₁₂", f"{src}:503-521"),
        ])
        setup = [
            _item(f"{precision} parameters (flat, full)", Category.PARAMS, Location.GPU, g * padded, f"{g}Ψ₁₂",
                  f"{src}:505-509"),
            *frozen,
            _item("fp32 master partition", Category.MASTER_WEIGHTS, opt_place, FP32 * p, "4P", f"{src}:560"),
            _item("zero fp32 gradient partition", Category.GRADS, opt_place, FP32 * p, "4P", f"{src}:934-941"),
        ]
        if candidate.offload_optimizer is not OffloadDevice.NONE:
            setup += [
                _item(f"{precision} parameter staging partition (pinned)", Category.BUFFERS, Location.HOST, g * p,
                      f"{g}P", f"{src}:566-575"),
                _item("temp gradient buffers for offload", Category.BUFFERS, Location.GPU, 2 * g * largest_tensor,
                      f"2·{g}Lₜ", f"{src}:653-661"),
            ]
        moments.append(setup)
        return moments
    src = f"{DS} runtime/zero/stage3.py"
    if construction is not Construction.ZERO_INIT:
        moments.append([
            _item(f"whole {precision} model on the device while it is partitioned", Category.PARAMS, Location.GPU,
                  g * (psi - four_bit) + four_bit_bytes, f"{g}(Ψ − Ψ₄) + 4-bit bytes" if four_bit else f"{g}Ψ",
                  f"{DS} partition_parameters.py:1193-1207 (Init(module=model))"),
            _item(f"{precision} partition of one tensor", Category.PARAMS, param_place, g * cast,
                  f"{g}Lₜ", f"{DS} partition_parameters.py:1836"),
        ])
    nvme_optimizer = candidate.offload_optimizer is OffloadDevice.NVME
    master = _item("fp32 master partition", Category.MASTER_WEIGHTS, opt_place, FP32 * (s if nvme_optimizer else qt),
                   "4S" if nvme_optimizer else f"4{qsym}", f"{src}:1157-1172")
    bucket_item = _item(f"gradient bucket (reduce_bucket_size = {bucket:,})", Category.BUFFERS, Location.GPU,
                        g * bucket, f"{g}·B", f"{src}:779-784")
    if candidate.offload_param is OffloadDevice.NONE:  # defragment() goes through a host buffer
        flat = [_item(f"{precision} parameter partition", Category.PARAMS, Location.GPU, g * q, f"{g}Q",
                      f"{src}:967-973"),
                _item(f"{precision} defragmentation buffer (host)", Category.BUFFERS, Location.HOST, g * q, f"{g}Q",
                      f"{DS} runtime/zero/utils.py:215-243 (partitions copied to the host, then back)")]
    elif candidate.offload_param is OffloadDevice.CPU:
        flat = [_item(f"{precision} parameter partition + its flat pinned copy", Category.PARAMS, Location.HOST,
                      2 * g * q, f"2·{g}Q", f"{src}:975-995, 888-911 (_create_param_groups_fp16_flat_cpu_memory)")]
    else:  # NVMe: the partitions are swapped out; pinned RAM holds at most max_in_cpu of them (:888-911)
        flat = [
            _item(f"{precision} parameter partition files", Category.PARAMS, Location.NVME, g * q, f"{g}Q",
                  f"{DS} partition_parameters.py:1816-1824"),
            _item(f"{precision} flat pinned copy (≤ max_in_cpu)", Category.PARAMS, Location.HOST,
                  g * min(q, DEEPSPEED_PARAM_MAX_IN_CPU), f"{g}·min(Q, max_in_cpu)", f"{src}:888-911"),
            _item("parameter swap buffers (buffer_count × buffer_size)", Category.BUFFERS, Location.HOST,
                  DEEPSPEED_PARAM_SWAP_BUFFERS * DEEPSPEED_PARAM_SWAP_BUFFER_ELEMENTS * g, f"5·1e8·{g}",
                  f"{DS} swap_tensor/partitioned_param_swapper.py:104-127"),
        ]
    defrag = [
        *flat,
        master, bucket_item,
        _item("largest module gathered", Category.PARAMS, Location.GPU, 2 * g * largest_module, f"2·{g}·LL",
              f"{DS} partition_parameters.py (all-gather buffer + gathered)"),
    ]
    settled = {  # the partition once defragmented: the flat buffer alone (the old partitions are freed)
        OffloadDevice.NONE: [_item(f"{precision} parameter partition (flat)", Category.PARAMS, Location.GPU, g * q,
                                   f"{g}Q", f"{src} _create_fp16_partitions_with_defragmentation")],
        OffloadDevice.CPU: [_item(f"{precision} parameter partition (flat, pinned)", Category.PARAMS, Location.HOST,
                                  g * q, f"{g}Q", f"{src}:888-911")],
    }.get(candidate.offload_param, flat)
    # initialize_optimizer_states (:1301-1344) zeroes one sub-group-sized FP32 buffer on self.device, which is
    # the host whenever the optimizer is offloaded (:333); with CPU offload each sub-group also gets its own
    # zero gradient, pinned and kept (:1337-1342).
    setup_grads = _item("zero fp32 gradient sub-group for optimizer set-up", Category.GRADS, opt_place, FP32 * s,
                        "4S", f"{src}:333, 1301-1306")
    setup = [*settled, master, bucket_item, setup_grads]
    if candidate.offload_optimizer is OffloadDevice.CPU:
        setup.append(_item("fp32 gradient partition (pinned)", Category.GRADS, Location.HOST, FP32 * qt, f"4{qsym}",
                           f"{src}:1337-1342"))
        if device_bytes is not None:  # a real pin_memory copies the sub-group's zeros to page-locked memory
            setup.append(_item("one sub-group's zero gradient while it is pinned", Category.BUFFERS, Location.HOST,
                               FP32 * s, "4S", f"{src}:1338-1340; {DS} accelerator/abstract_accelerator.py:335-339"))
    moments += [defrag, setup]
    return moments


def _bytes(moment: Sequence[LedgerItem], where: tuple[Location, ...]) -> int:
    return sum(item.bytes for item in moment if item.location in where)


def moment_bytes(moment: Sequence[LedgerItem], *, device_is_host: bool) -> int:
    """Bytes of ``moment`` on the device (CPU ranks: on the device and the host, one memory)."""
    return _bytes(moment, (Location.GPU, Location.HOST) if device_is_host else (Location.GPU,))


def init_items(moments: Sequence[Moment], *, device_is_host: bool) -> list[LedgerItem]:
    """The init phase's items: per memory, the moment that holds the most there."""
    if device_is_host:  # CPU ranks: device and host are one memory, so one moment is the peak of both
        return list(max(moments, key=lambda m: _bytes(m, (Location.GPU, Location.HOST))))
    gpu = max(moments, key=lambda m: _bytes(m, (Location.GPU,)))
    host = max(moments, key=lambda m: _bytes(m, (Location.HOST,)))
    nvme = max(moments, key=lambda m: _bytes(m, (Location.NVME,)))
    return ([i for i in gpu if i.location is Location.GPU] + [i for i in host if i.location is Location.HOST]
            + [i for i in nvme if i.location is Location.NVME])
