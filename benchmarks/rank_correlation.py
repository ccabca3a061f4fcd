"""Spearman's rank correlation, ties given their average rank (numpy only; the replays and the probe's rank order)."""

from __future__ import annotations

import numpy as np


def spearman(a: list[float], b: list[float]) -> float:
    """ρ of ``a`` and ``b``: the Pearson correlation of their ranks."""

    def ranks(values: list[float]) -> np.ndarray:
        order = np.argsort(values, kind="mergesort")
        r = np.empty(len(values))
        r[order] = np.arange(len(values), dtype=float)
        for value in set(values):  # average ranks of ties
            idx = [i for i, v in enumerate(values) if v == value]
            r[idx] = r[idx].mean()
        return r

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])
