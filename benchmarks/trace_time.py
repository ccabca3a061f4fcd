"""Benchmark: how long tracing a ~1.3B-parameter GPT on fake tensors takes (issue 7: "seconds, no GPU").

    python benchmarks/trace_time.py

A GPT-2-XL-like shape (24 layers, h=2048, 16 heads, vocab 50,257, 1,024 tokens, micro-batch 1, bf16), one
forward + backward per checkpointing granularity, no cache. Prints the wall time and the traced figures;
asserts nothing.
"""

from __future__ import annotations

import time

from launchers.trace import TraceResult, trace
from optimizer.knobs import Precision

SPEC = {"layers": 24, "hidden_size": 2048, "heads": 16, "kv_heads": 16, "ffn_size": 8192, "vocab_size": 50257,
        "tied_embeddings": True, "attention": "eager", "mlp": "gelu", "norm": "layernorm", "bias": True,
        "position_embedding": "learned", "dropout": True, "max_positions": 1024, "entry_point": None}


def main() -> None:
    for checkpointing in ("none", "selective", "full"):
        start = time.monotonic()
        result = trace(model_spec=SPEC, entry_point=None, checkpointing=checkpointing, precision=Precision.BF16,
                       micro_batch=1, sequence_length=1024)
        wall = time.monotonic() - start
        if isinstance(result, TraceResult):
            print(f"{checkpointing:<10} {wall:5.1f} s  parameters {result.parameters:,}  activations "
                  f"{result.activation_bytes / 1e9:.3f} GB  temporaries {result.temporary_bytes / 1e9:.3f} GB  "
                  f"peak {result.peak_bytes / 1e9:.3f} GB ({result.peak_phase}); GB = 10^9 bytes")
        else:
            print(f"{checkpointing:<10} {wall:5.1f} s  trace failed at {result.op}: {result.message}")


if __name__ == "__main__":
    main()
