"""One line of the memory ledger: what is held, where, when, and the formula behind it (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Location(StrEnum):
    """Where bytes live."""

    GPU = "gpu"
    HOST = "host"
    NVME = "nvme"


class Category(StrEnum):
    """What the bytes are, as the seed's tables group them."""

    PARAMS = "params"
    GRADS = "grads"
    OPTIMIZER = "optimizer"
    MASTER_WEIGHTS = "master_weights"
    ACTIVATIONS = "activations"
    BUFFERS = "buffers"


class Phase(StrEnum):
    """When an item is live.

    ``always`` items coexist with whichever transient phase is largest; ``init`` items exist only
    before DeepSpeed has placed the model (nothing else is allocated yet).
    """

    ALWAYS = "always"
    INIT = "init"
    FORWARD = "forward"
    """Forward and the start of backward, before autograd made any gradient: activations at their high-water mark
    of those moments, no ZeRO-2 gradient bucket or partition yet (they are allocated at the first gradient's
    hook). Used where a trace split the activations at that moment (:attr:`TracedActivation.split_points`)."""
    BACKWARD = "backward"
    """Forward→backward: activations, gradient buckets, gathered ZeRO-3 parameters."""
    REDUCE = "reduce"
    """After backward: gradients reduced into their partitions."""
    STEP = "step"
    """The optimizer step: FP32 gradient copies, norms."""
    GATHER = "gather"
    """After the optimizer step of ZeRO-1/2: the updated partitions all-gathered into the parameters (on CPU
    ranks gloo allocates the gathered tensor; NCCL writes in place)."""


TRANSIENT_PHASES = (Phase.BACKWARD, Phase.FORWARD, Phase.REDUCE, Phase.STEP, Phase.GATHER)


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerItem:
    """One line of the ledger: a tensor class, its bytes per rank and where they come from."""

    name: str
    """What is held, e.g. ``"Adam exp_avg + exp_avg_sq"``."""
    category: Category
    """Which column of the seed's tables it belongs to."""
    location: Location
    """GPU, host RAM or NVMe."""
    bytes: int
    """Bytes held by one rank."""
    formula: str
    """The arithmetic, e.g. ``8·Ψ/N``."""
    source: str
    """Where the formula comes from (paper, DeepSpeed file, the seed)."""
    phase: Phase = Phase.ALWAYS
    """When it is live."""
    sometimes: bool = False
    """Live at its phase in some runs and not in others (a buffer another thread frees early or late): kept out
    of what the candidate needs (:attr:`optimizer.ledger.core.Ledger.risks`) and priced by the launch policy as
    risk (:attr:`optimizer.ledger.core.Ledger.risk_bytes`), never a reason to prune."""
