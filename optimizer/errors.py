"""The one error type for user mistakes.

Every bad input — a malformed study file, an unknown key, an impossible value, a knob the
CLI cannot parse — raises :class:`UserError`. The CLI prints it on one line and exits 2.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in what the user gave us: names the source, the key and why.

    ``source`` is a file path or a pseudo-source such as ``--set``; ``key`` is a dotted
    path inside it (``hardware.gpu_memory``) or empty when the whole source is at fault.
    """

    def __init__(self, *, source: str, key: str, why: str) -> None:
        self.source = source
        self.key = key
        self.why = why
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {why}")
