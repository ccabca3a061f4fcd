"""Whether training draws random numbers, measured in the rank: the default generators' state before a micro-step's
forward and after its backward.

Dropout (``aten::native_dropout`` → ``bernoulli_``), and any other sampling a model does while it trains, advances
the generator of the device it runs on; recomputation under ``torch.utils.checkpoint`` restores the state it drew
from (``preserve_rng_state``), so a micro-step that draws nothing leaves both generators as they were. The rank
reports ``draws_random``; an FP32 reference run that drew makes every candidate be judged against the reference at
its own micro-batch size (:func:`launchers.trial.reference_batches.draws_random`) — for a model whose dropout the
study's model section does not say (a script's model given by its shape, an entry point's).

What is read: the CPU generator's state (``torch.random.get_rng_state``, a 5,056-byte tensor, hashed and dropped at
once, before the forward's activations exist) and, where CUDA is initialized, the current device's Philox state
(16 bytes). Once a draw is seen nothing more is read.
"""

from __future__ import annotations

import hashlib
from typing import Any


class DrawWatch:
    """``before()`` at a micro-step's forward, ``after()`` at the end of its backward; :attr:`drew` once any
    micro-step drew."""

    def __init__(self) -> None:
        self.drew = False
        self._before: bytes | None = None
        self._cuda = False

    def before(self, *, watch: bool = True) -> None:
        """At a micro-step's forward; ``watch`` False: not this one (a timed step)."""
        if watch and not self.drew:
            self._cuda = _cuda_ready()  # decided here: CUDA initialized inside the step is not a draw
            self._before = _fingerprint(cuda=self._cuda)

    def after(self) -> None:
        """At the end of its backward."""
        if not self.drew and self._before is not None:
            self.drew = _fingerprint(cuda=self._cuda) != self._before
        self._before = None


def _cuda_ready() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _fingerprint(*, cuda: bool) -> bytes:
    import torch

    digest = hashlib.sha1(_bytes(torch.random.get_rng_state()))
    if cuda:
        digest.update(_bytes(torch.cuda.get_rng_state()))
    return digest.digest()


def _bytes(state: Any) -> bytes:
    return state.numpy().tobytes()
