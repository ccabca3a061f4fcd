"""dsopt: search-based optimizer for DeepSpeed training configurations.

The library is a pure core (specs, search space, memory ledger) with I/O at the edges
(study-file loading, the CLI); docs/layout.md draws the layers.
"""

__version__ = "0.1.0"
