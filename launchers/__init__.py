"""Everything that starts processes or touches a device lives here (STYLE.md: I/O at the edges).

The trial launcher (one short real DeepSpeed run per candidate) arrives with the trial issue;
the library in ``optimizer/`` stays pure.
"""
