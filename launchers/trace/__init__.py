"""What is learnt from the model before any launch: fake-tensor traces (``tracer``, ``trace_depth``), the
parameter inventory (``inventory``), the study's traced activations (``study_traces``) and their caches."""
