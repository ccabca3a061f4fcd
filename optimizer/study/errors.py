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


def error_summary(err: BaseException, *, lines: int = 3, limit: int = 300) -> str:
    """An exception's first non-empty ``lines`` lines joined on one line, at most ``limit`` characters (a
    library's message that puts the field on line 1 and the reason on line 2 keeps both)."""
    text = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return " ".join(text[:lines])[:limit]
