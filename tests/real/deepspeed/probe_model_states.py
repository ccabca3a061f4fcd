"""Rank program for test_model_states_real.py: what DeepSpeed really allocates, tensor by tensor.

Run under ``torchrun --nproc_per_node 2`` with ``DS_ACCELERATOR=cpu``. Arguments: a JSON file of
cases and an output folder. Each case builds a small GPT whose parameter layout is the one
``optimizer.ledger.transformer.parameter_tensors`` describes, trains one step with the given DeepSpeed
config, and records the bytes of DeepSpeed's model-state tensors (DeepSpeed 0.19.8 attribute
names; a rename fails the test, which is the point: the ledger must then be re-read against the
new source). Writes ``<out>/<case>.rank<r>.json``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(h)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.norm2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, ffn)
        self.proj = nn.Linear(ffn, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.norm1(x)
        q, k, v = (t(y).view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (self.q, self.k, self.v))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, h))
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, *, layers: int, hidden: int, heads: int, ffn: int, vocab: int, positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.embed_positions = nn.Embedding(positions, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, ffn) for _ in range(layers))
        self.final_norm = nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed_tokens(tokens) + self.embed_positions(positions)
        for block in self.layers:
            x = block(x)
        logits = self.final_norm(x) @ self.embed_tokens.weight.t()  # tied LM head
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def adam_state_bytes(optimizer) -> int:
    return sum(nbytes([v for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")])
               for state in optimizer.state.values())


def measure(engine) -> dict[str, int]:
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    out = {"psi": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())}
    if stage in (1, 2):
        out["params"] = nbytes(opt.bit16_groups_flat)
        out["master"] = nbytes(opt.single_partition_of_fp32_groups)
        out["adam"] = adam_state_bytes(opt.optimizer)
        pairs = zip(opt.single_partition_of_fp32_groups, opt.bit16_groups_flat, strict=True)
        out["master_is_a_copy"] = int(all(
            m.untyped_storage().data_ptr() != f.untyped_storage().data_ptr() for m, f in pairs))
        out["host_fp32_grads"] = nbytes([m.grad for m in opt.single_partition_of_fp32_groups]) if opt.cpu_offload else 0
    else:
        out["params"] = nbytes([opt.lp_param_buffer]) if getattr(opt, "lp_param_buffer", None) is not None \
            else nbytes(opt.fp16_partitioned_groups_flat)
        out["grad_partition"] = nbytes([opt.grad_partitions_flat_buffer])
        out["master"] = nbytes(opt.fp32_partitioned_groups_flat)
        out["adam"] = adam_state_bytes(opt.optimizer)
        out["bucket"] = nbytes([b.buffer for b in opt.ipg_buckets.values()])
        out["persistent"] = sum(p.ds_numel * p.element_size() for p in engine.module.parameters()
                                if getattr(p, "ds_persist", False))
    return out


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    for case in cases:
        torch.manual_seed(0)
        model = TinyGPT(**case["model"])
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=case["config"])
        tokens = torch.randint(0, case["model"]["vocab"], (case["config"]["train_micro_batch_size_per_gpu"],
                                                          case["seq"]), device=engine.device)
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        result = measure(engine)
        (out_dir / f"{case['name']}.rank{rank}.json").write_text(json.dumps(result))
        engine.destroy()
        del engine, model
        gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # no interpreter teardown, as the trials' ranks end (launchers/process/collector.py end_rank):
    sys.stderr.flush()  # gloo's threads may abort it after the work is done ("terminate called without an active
    os._exit(0)         # exception")
