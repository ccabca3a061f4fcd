"""Everything that starts processes or touches a device lives here (I/O at the edges): the trial launcher, the
worker loop, SLURM, the tracer and what runs inside the ranks, in rooms (docs/layout.md). The library in
``optimizer/`` (except the CLI, the top layer) never imports it (tests/test_layers.py).
"""
