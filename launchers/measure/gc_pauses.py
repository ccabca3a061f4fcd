"""CPython's cyclic collections in a trial's measured steps: the heap settled before them, their time counted.

A trial measures few steps (3 by default) of a process that imported torch, DeepSpeed, transformers and, through
bitsandbytes' ``torch.library`` ops, ``torch._dynamo`` and sympy: millions of objects that a full (generation-2)
collection scans. On a 2-core Xeon one such collection took ~0.2 s against a 35 ms step: on grid-qlora-llama-cpu
two of them fell into the first measured steps of ZeRO-1/2 with full checkpointing (py-spy: ``gc_collect_main``
under bitsandbytes' ``backends/cpu/ops.py``), the median step read 215 ms, and 40 steps of the same launch ran at
~33 ms once they had passed. A long run rarely pays them: CPython 3.11 starts a full collection only once the
objects that survived younger collections since the last one exceed a quarter of the long-lived ones
(``Modules/gcmodule.c``, ``gc_collect_generations``: ``long_lived_pending < long_lived_total / 4`` skips it), and a
training loop's heap stops growing after its first steps. Training code of the field keeps them off the step
altogether: torchtitan disables automatic collection and collects generation 1 every ``gc_freq`` steps "to avoid
stragglers in garbage collection" (``torchtitan/tools/utils.py``, ``GarbageCollection``), OLMo-core's
``GarbageCollectorCallback`` does the same in every distributed run.

:func:`settle_heap` collects once and freezes what survives (``gc.freeze``: moved to the permanent generation,
ignored by later collections), after the warm-up and before the first measured step's clock starts, so the
measured steps see the steady heap of a long run. Collections stay enabled: the steps' own garbage is collected
and timed as a run without torchtitan's switch pays it. :class:`GcPauses` records every collection from then on
until the report (``gc.callbacks``) — the untimed bookkeeping between the measured steps included — and reports
their count per generation and total time beside the step times; :meth:`GcPauses.finish` thaws the heap again.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any


def settle_heap() -> None:
    """Collect every generation and freeze the survivors (the warm-up's long-lived heap): outside any timed step."""
    gc.collect()
    gc.freeze()


@dataclass
class GcPauses:
    """The cyclic collections run while it watches: count per generation and total seconds (``gc.callbacks``)."""

    counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: float = 0.0
    watching: bool = False
    started: bool = False
    """Whether it ever watched (the measured steps began)."""
    _started: float | None = None

    def settle_and_start(self) -> None:
        """:func:`settle_heap`, then watch every collection from now on: as a rank's measured steps begin."""
        settle_heap()
        self.start()

    def start(self) -> None:
        """Watch every collection from now on (idempotent)."""
        if not self.watching:
            gc.callbacks.append(self._callback)
            self.watching = self.started = True

    def stop(self) -> None:
        """Watch no more (idempotent); the counts stay."""
        if self.watching:
            gc.callbacks.remove(self._callback)
            self.watching = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.counts[min(int(info.get("generation", 0)), 2)] += 1
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def finish(self) -> dict[str, Any] | None:
        """Stop watching, thaw the frozen heap (``gc.unfreeze``: the engine's reference cycles can be collected
        again once it is destroyed, before the probe that may follow in the same process), and :meth:`report`."""
        self.stop()
        gc.unfreeze()
        return self.report()

    def report(self) -> dict[str, Any] | None:
        """The rank report's ``gc_pauses``: ``{"collections": [gen0, gen1, gen2], "seconds": s}`` since the start;
        None if it never started (no measured step)."""
        if not self.started:
            return None
        return {"collections": list(self.counts), "seconds": self.seconds}
