"""The analytic memory ledger: every byte per GPU, per host and on NVMe, itemised with its source (pure).

:func:`optimizer.ledger.core.evaluate` turns a candidate into a :class:`~optimizer.ledger.core.Verdict`; the
items come from :mod:`~optimizer.ledger.model_states` (what DeepSpeed allocates), :mod:`~optimizer.ledger.activations`
(activations: formula or trace), :mod:`~optimizer.ledger.init_phase` (building the model) and
:mod:`~optimizer.ledger.seed` (the seed document's own accounting)."""
