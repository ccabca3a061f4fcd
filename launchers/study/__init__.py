"""The study as a process runs it: the process side of a worker (``study_run``: storage, traces, the real launches,
handed to :mod:`optimizer.search.study_loop`), the ops built before the first launch (``op_prep``), what it prints
(``progress``), its files in Optuna's artifact store (``artifacts``), the demo."""
