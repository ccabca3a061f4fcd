"""Speed: the throughput model, the accelerators' figures it uses, and per-study calibration (pure)."""
