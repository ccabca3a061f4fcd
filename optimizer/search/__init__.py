"""The Optuna study: the objective (prune, reuse, launch), the order of launches, many workers on one storage."""
