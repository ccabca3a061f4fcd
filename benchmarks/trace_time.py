"""Benchmark: how long tracing a ~1.3B-parameter GPT on fake tensors takes.

    python benchmarks/trace_time.py

A GPT-2-XL-like shape (24 layers, h=2048, 16 heads, vocab 50,257, 1,024 tokens, bf16), one forward + backward
per checkpointing granularity at micro-batch 1 and 8 (the trace's time should not grow with the batch: fake
tensors allocate nothing), no cache. Prints the wall time and the traced figures beside the formula; asserts
nothing.
"""

from __future__ import annotations

import time

from launchers.trace.tracer import TraceResult, trace
from optimizer.ledger.transformer import activation_estimate
from optimizer.study.knobs import Precision, parse_checkpointing
from optimizer.study.specs import TransformerModel

SPEC = {"layers": 24, "hidden_size": 2048, "heads": 16, "kv_heads": 16, "ffn_size": 8192, "vocab_size": 50257,
        "tied_embeddings": True, "attention": "eager", "mlp": "gelu", "norm": "layernorm", "bias": True,
        "position_embedding": "learned", "dropout": True, "max_positions": 1024, "entry_point": None,
        "hf_config": None}


def main() -> None:
    model = TransformerModel(**{k: v for k, v in SPEC.items() if k != "hf_config"})
    print("GB = 10^9 bytes; peak = high-water mark of activations + temporaries; kept = live when forward ends")
    for checkpointing in ("none", "selective", "full"):
        for micro_batch in (1, 8):
            start = time.monotonic()
            result = trace(model_spec=SPEC, checkpointing=checkpointing, precision=Precision.BF16,
                           micro_batch=micro_batch, sequence_length=1024)
            wall = time.monotonic() - start
            formula = activation_estimate(model, checkpointing=parse_checkpointing(checkpointing), seq=1024,
                                          micro_batch=micro_batch, element_bytes=2)
            if isinstance(result, TraceResult):
                print(f"{checkpointing:<10} b={micro_batch}  {wall:5.1f} s  parameters {result.parameters:,}  "
                      f"peak {result.activation_peak_bytes / 1e9:.3f} GB ({result.peak_phase})  kept "
                      f"{result.stored_bytes / 1e9:.3f} GB  formula {formula.total_bytes / 1e9:.3f} GB")
            else:
                print(f"{checkpointing:<10} b={micro_batch}  {wall:5.1f} s  trace failed at {result.op}: "
                      f"{result.message}")


if __name__ == "__main__":
    main()
