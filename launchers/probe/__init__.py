"""The probe of the machine's kernels: its ranks started on this node, their timings merged and cached."""
