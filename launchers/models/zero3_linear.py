"""What a ZeRO-3 run saves for backward in every ``nn.Linear``: DeepSpeed's linear, for the traces.

``deepspeed.zero.Init`` (and the ZeRO-3 engine for a model built without it, ``parameter_offload.py:270`` →
``partition_parameters.py:1090``) replaces ``torch.nn.functional.linear`` with ``zero3_linear_wrap``
(``partition_parameters.py:412-419``, "This will persist unless manually reset") for the rest of the process. Its
``LinearFunctionForZeroStage3`` saves input, weight and bias for backward whatever needs a gradient
(``runtime/zero/linear.py:100-105``), where autograd's own linear keeps a frozen Linear's input only when its weight
trains. For a full fine-tune the two keep the same tensors; for a frozen base (LoRA, frozen layers) every frozen
Linear's input stays alive to the backward. :func:`deepspeed_linear` puts the same saving in place for a trace (a
copy of its forward and of what it saves: importing DeepSpeed in every trace process would cost seconds; its
backward is only what ``linear.py:108-143`` computes). GPT-2's ``Conv1D`` (``torch.addmm``) is not a Linear and
is untouched, as in the real run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class _Zero3Linear(torch.autograd.Function):
    """``LinearFunctionForZeroStage3`` (DeepSpeed 0.19.8 ``runtime/zero/linear.py:80-143``) without its gathers:
    a trace's parameters are whole."""

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if input.dim() == 2 and bias is not None:
            return torch.addmm(bias, input, weight.t())
        output = input.matmul(weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        input, weight, bias = inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None
        ctx.save_for_backward(input, weight, bias)  # linear.py:105: all three, whatever trains

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def _zero3_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _Zero3Linear.apply(input, weight, bias)


@contextlib.contextmanager
def deepspeed_linear() -> Iterator[None]:
    """``torch.nn.functional.linear`` as a ZeRO-3 run has it, restored on exit."""
    previous = torch.nn.functional.linear
    torch.nn.functional.linear = _zero3_linear
    try:
        yield
    finally:
        torch.nn.functional.linear = previous
