"""DeepSpeed's JIT-built ops: which a candidate needs (``op_needs``), building them (``op_load``), stale locks."""
