"""The study loop as a process sees it: a worker's launches in order (``study_run``), the ops built before the
first (``op_prep``), what it prints (``progress``), its files in Optuna's artifact store (``artifacts``), the demo."""
