"""How many parameters ZeRO-3 keeps gathered at once: DeepSpeed's fetch/prefetch/release rules replayed (pure).

ZeRO-3 gathers a module's parameters when the module runs and releases them after, but its coordinator
(``runtime/zero/partitioned_param_coordinator.py``, DeepSpeed 0.19.8) keeps more than the module at hand. Once
it has recorded one step's module order (the "trace"), every ``fetch_sub_module`` call

1. pops the queue entries of the module's own parameters (``:420-437``) and marks each parameter with the step
   of that use;
2. prefetches: pops further entries while fewer than ``min(max_live − available, prefetch_bucket)`` elements
   are being prefetched, at least one entry per call, marking *every* popped entry's parameter with the step of
   its use — also a parameter already gathered (``:452-476``);

and ``release_sub_module`` (``:494``, ``__params_to_release`` ``:634-665``) keeps every parameter whose mark lies
past the current step, and every parameter used again within ``max_reuse_distance`` elements of the module
order. So the prefetch front runs ahead of the modules (one entry per call at least, containers included),
reaches backward's entries before forward ends, and the parameters it marks for their backward use stay
gathered across the forward→backward turn: measured on 2 CPU ranks (qwen2, h 64, 2/4/8 layers, fp32), 111,680
of 156,736, 157,504 of 247,872 and 253,248 of 430,144 parameters were gathered when forward ended, where "the
largest module twice + one prefetch bucket" says 69,000. :func:`replay` replays those rules over a
traced module order (:mod:`launchers.trace.tracer`): the most non-persistent elements gathered at once.

A checkpointed block's recomputation (a forward inside backward) is replayed as DeepSpeed 0.19.8 holds it: each
*frozen* parameter it fetches is attributed to the module whose backward is newest (``__active_backward_submodules``,
filled at each backward fetch, ``:340-341``; ``update_recompute_parameters`` ``:37-40``, called at ``:389-393``)
and stays gathered until that module's backward ends (``release_sub_module`` ``:501-504, 517-525``;
``__release_param`` keeps a parameter some module still holds, ``:625``): with LoRA or a frozen base and full
checkpointing, the whole recomputed block's frozen weights are gathered at once while it runs.

A prefetch of more than one parameter is one coalesced all-gather (``partition_parameters.py:1598-1600``): a flat
buffer, from which each parameter gets its own copy when the first of them is waited for (``:781-796``, the
``torch.cat``); the handle keeps the buffer (``self.partitions``, ``:750``) and the in-flight registry keeps the
handle for every parameter of the bucket until that parameter's own module fetches it (coordinator ``:398-406,
613``). So
from the first wait until the last member is fetched the bucket is held twice: ``buffers`` adds those flat
buffers. In the first step that prefetches, the persistent parameters arrive partitioned (the step that records
the trace releases every parameter after use, persistent ones included, ``:498-499``) and are fetched with the
rest, so they join buckets and make more of them coalesced; later steps find them gathered: ``first_step``
replays the former. Both checked event by event against real DeepSpeed on 2 CPU ranks
(``tests/real/deepspeed/test_zero3_recompute_real.py``).

A bitsandbytes 4-bit layer's weight outlives its release. ``MatMul4Bit.forward`` (bitsandbytes 0.50.2
``autograd/_functions.py:357-358``) keeps the packed weight for backward as ``ctx.tensors = (None, B)`` — an
attribute of the autograd node, not a saved tensor, so backward does not free it: it lives as long as the node, i.e.
as long as anything holds the step's graph. ZeRO-3 releases a parameter by pointing ``param.data`` at an empty
tensor (``partition_parameters.py:329``), which leaves that view's storage alive. So (``autograd_held``): once such
a weight was used in forward, its first release after that use leaves its forward copy behind until the step ends,
and a re-gather in backward is a second copy; and (``previous_graph``) a loop that keeps the last micro-step's
``loss`` while the next forward runs (``loss = engine(batch)``, DeepSpeed's own examples and dsopt's trial) holds
the previous micro-step's copies of all of them until that forward returns (the model's own forward ends) — ZeRO-3
released every parameter after the previous backward (``release_and_reset_all``), so they are copies apart from this
step's gathers. Measured on 2 CPU
ranks (the 4096-wide QLoRA Llama, ZeRO-3 bf16): dropping ``loss`` after ``backward`` lowers the training peak by
767 kB, its six MLP weights' packed bytes (786 kB).

Not replayed: the step that records the trace (everything is released after use, so less is gathered), NVMe
prefetch, leaf modules (``z3_leaf_module``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

PRE = ("forward_pre", "backward_pre")
"""Module events at which DeepSpeed fetches (and records the module in its trace)."""
POST = ("forward_post", "backward_post")
"""Module events at which DeepSpeed releases."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GatherSettings:
    """The coordinator's sizes (elements; :mod:`optimizer.deepspeed.zero_settings`)."""

    prefetch_bucket: int
    max_live: int
    max_reuse_distance: int
    persistence_threshold: int


def replay(*, events: Sequence[tuple[str, int]], module_params: Sequence[Sequence[int]],
           param_numel: Sequence[int], settings: GatherSettings,
           weights: Sequence[int] | None = None, frozen: Collection[int] = (),
           buffers: bool = False, first_step: bool = False) -> list[int]:
    """Non-persistent parameter elements gathered after each of ``events`` over one traced step.

    ``events``: (kind, module index) in the order the step ran them, kind one of :data:`PRE` or :data:`POST`;
    ``module_params[m]``: the parameter indices module ``m`` owns directly; ``param_numel[p]``: elements (what the
    coordinator's sizes count). ``weights[p]``: what each gathered parameter adds to the result instead of its
    elements (its bytes, in its own dtype: the result is then the bytes gathered); the rules still count elements.
    ``frozen``: the parameters that do not train, which a checkpointed block's recomputation holds (module doc).
    ``buffers``: add the coalesced prefetch buckets' flat buffers that outlive their wait (module doc).
    ``first_step``: the first step that prefetches, whose persistent parameters arrive partitioned (module doc)."""
    return _replay(events=events, module_params=module_params, param_numel=param_numel, settings=settings,
                   weights=weights, frozen=frozen, buffers=buffers, first_step=first_step)[0]


def autograd_copies(*, events: Sequence[tuple[str, int]], module_params: Sequence[Sequence[int]],
                    param_numel: Sequence[int], settings: GatherSettings, held: Collection[int],
                    weights: Sequence[int] | None = None, frozen: Collection[int] = (),
                    previous_graph: bool = False) -> list[int]:
    """After each of ``events`` (as :func:`replay`), the bytes of parameter copies that autograd keeps past
    ZeRO-3's release (module doc) — on top of what the coordinator holds gathered, and not bounded by its
    ``max_live``: ``held`` the parameters whose forward copy autograd keeps until the step's graph is freed (a
    4-bit weight whose matmul kept it); each one's forward copy once released, and with ``previous_graph`` the
    previous micro-step's copies of all of them until the model's forward returns (the first event's module ends)."""
    return _replay(events=events, module_params=module_params, param_numel=param_numel, settings=settings,
                   weights=weights, frozen=frozen, autograd_held=held, previous_graph=previous_graph)[1]


def _replay(*, events: Sequence[tuple[str, int]], module_params: Sequence[Sequence[int]],
            param_numel: Sequence[int], settings: GatherSettings,
            weights: Sequence[int] | None = None, frozen: Collection[int] = (),
            buffers: bool = False, first_step: bool = False, autograd_held: Collection[int] = (),
            previous_graph: bool = False) -> tuple[list[int], list[int]]:
    """:func:`replay`'s bytes and :func:`autograd_copies`' after each event, in one pass."""
    weight = param_numel if weights is None else weights
    frozen = set(frozen)
    persistent = {p for p, n in enumerate(param_numel) if n <= settings.persistence_threshold}
    order = [m for kind, m in events if kind in PRE]
    queue: deque[tuple[int, int]] = deque((p, step) for step, m in enumerate(order)
                                          for p in sorted(set(module_params[m])))
    mark: dict[int, int] = {}
    available: set[int] = set()
    n_available = 0
    weighed = 0
    step = 0
    after: list[int] = []
    copies: list[int] = []
    active: dict[int, None] = {}  # modules in backward, in the order it began (__active_backward_submodules)
    holders: dict[int, set[int]] = {}  # a frozen parameter fetched in a recomputation -> the modules holding it
    recomputed: dict[int, set[int]] = {}  # a module in backward -> the frozen parameters its recomputation fetched
    bucket_of: dict[int, int] = {}  # a prefetched parameter still in the in-flight registry -> its bucket
    members: dict[int, set[int]] = {}  # a bucket -> its parameters still in the registry
    flat: dict[int, int] = {}  # a bucket whose wait has run -> its flat buffer, kept while a member is registered
    buckets: list[frozenset[int]] = []
    resident: set[int] = set() if first_step else set(persistent)  # persistent parameters gathered by now
    held = set(autograd_held) - persistent  # a persistent parameter is never released: one copy
    in_node: set[int] = set()  # held parameters whose forward copy autograd keeps (used in forward, not yet released)
    orphaned = 0  # bytes of released forward copies that autograd keeps
    previous = sum(weight[p] for p in held) if previous_graph else 0  # the last micro-step's copies
    outer = events[0][1] if events else None  # the model: its forward returning into ``loss`` frees the old graph

    def gather(params: set[int]) -> None:
        nonlocal n_available, weighed
        for p in params - available - persistent:
            available.add(p)
            n_available += param_numel[p]
            weighed += weight[p]

    for kind, m in events:
        own = set(module_params[m])
        if kind == "backward_pre":
            active.setdefault(m)
            previous = 0
        if kind == "forward_pre" and not active:
            in_node |= own & held
        if kind in PRE:
            gather(own)
            resident |= own & persistent
            for p in own & bucket_of.keys():  # popped from the registry and waited (coordinator :398-406)
                bucket = bucket_of.pop(p)
                members[bucket].discard(p)
                flat[bucket] = sum(weight[q] for q in buckets[bucket])
                if not members[bucket]:
                    del members[bucket], flat[bucket]
            if kind == "forward_pre" and active:  # a forward inside backward: a checkpointed block recomputed
                owner = next(reversed(active))
                for p in own & frozen:
                    holders.setdefault(p, set()).add(owner)
                    recomputed.setdefault(owner, set()).add(p)
            not_fetched = {p for p in own if mark.get(p, -1) < step}
            popped: set[int] = set()
            while queue and len(popped) < len(not_fetched):
                p, used = queue.popleft()
                mark[p] = used
                popped.add(p)
            budget = min(settings.max_live - n_available, settings.prefetch_bucket)
            prefetch: set[int] = set()
            numel = 0
            while queue and numel < budget:
                p, used = queue.popleft()
                mark[p] = max(mark.get(p, -1), used)
                if p in persistent and p not in resident:  # fetched once, never released (counted as K)
                    resident.add(p)
                    prefetch.add(p)
                    numel += param_numel[p]
                elif p not in available and p not in persistent and p not in prefetch:
                    prefetch.add(p)
                    numel += param_numel[p]
            gather(prefetch - persistent)
            if len(prefetch) > 1:  # one coalesced all-gather: a flat buffer (partition_parameters.py:1598-1600)
                bucket = len(buckets)
                buckets.append(frozenset(prefetch))
                members[bucket] = set(prefetch)
                bucket_of.update(dict.fromkeys(prefetch, bucket))
            step += 1
        else:
            release = {p for p in own - persistent if mark.get(p, -1) <= step}
            traversed = 0
            for later in order[step:]:
                if traversed >= settings.max_reuse_distance:
                    break
                for p in module_params[later]:
                    release.discard(p)
                    traversed += param_numel[p]
            if kind == "backward_post":
                active.pop(m, None)
                for p in recomputed.pop(m, set()):
                    holders[p].discard(m)
                    release.add(p)
            release = {p for p in release if not holders.get(p)}
            for p in release & available:
                available.discard(p)
                n_available -= param_numel[p]
                weighed -= weight[p]
                if p in in_node:  # its storage lives on in the autograd node
                    in_node.discard(p)
                    orphaned += weight[p]
        if kind == "forward_post" and m == outer and not active:
            previous = 0  # forward returned into ``loss``: the previous graph is freed
        after.append(weighed + (sum(flat.values()) if buffers else 0))
        copies.append(orphaned + previous)
    return after, copies


def gathered(*, events: Sequence[tuple[str, int]], module_params: Sequence[Sequence[int]],
             param_numel: Sequence[int], settings: GatherSettings, frozen: Collection[int] = ()) -> tuple[int, int]:
    """(the most gathered at once, what is gathered when forward ends) over the step (:func:`replay`)."""
    after = replay(events=events, module_params=module_params, param_numel=param_numel, settings=settings,
                   frozen=frozen)
    cut = next((i for i, (kind, _) in enumerate(events) if kind.startswith("backward")), len(events))
    return max(after, default=0), after[cut - 1] if cut else 0
