"""The module events of a traced step in the order DeepSpeed's ZeRO-3 coordinator sees them: its hooks, copied.

The replay of the coordinator (:mod:`optimizer.deepspeed.zero3_gather`) needs the events that drive it — a module's
forward starting and ending, its backward starting and ending — in DeepSpeed's own order, and torch's ``ModTracker``
(what ``MemTracker`` tracks modules with) gives a different one in two places that matter:

* **A recomputation stopped early.** Non-reentrant checkpointing stops recomputing a block as soon as every tensor
  its first forward saved has been saved again (``torch/utils/checkpoint.py:1128``, ``_StopRecomputationError``,
  caught at ``:1184``): inside the block's last saving op, so the modules around it never end their forward.
  ``ModTracker`` ends them all the same (its forward hook is registered ``always_call=True``,
  ``mod_tracker.py:253``; ``module.py:1886-1897`` calls such hooks on an exception); DeepSpeed's hook is a plain
  forward hook (``parameter_offload.py:448``) and does not run, so the block's parameters stay gathered until their
  backward ends — the recomputation's peak.
* **Backward's order.** DeepSpeed marks a module's backward start and end with autograd functions of its own
  inserted in the graph — on the module's outputs (``PreBackwardFunctionForModule``, ``:466-484``, applied by the
  forward hook ``:410-414``) and on its positional inputs (``PostBackwardFunctionModule``, ``:497-524``, applied by
  a forward pre-hook ``:437-442``, counting the inputs that need a gradient). ``ModTracker`` hooks the tensors
  themselves, so where one module's output is the next one's input (a LoRA adapter's A feeding its B) the two
  fire in the opposite order, and inputs passed by keyword (transformers' attention) are never marked by DeepSpeed.

:func:`deepspeed_module_events` installs the same four hooks, in DeepSpeed's registration order
(``parameter_offload.py:445, 448, 487, 528``), on every module of the traced model and records
``(kind, module index)`` for each; the autograd functions return a detached alias (``outputs.detach()``, as
DeepSpeed's do), so nothing is allocated. Checked event for event against real DeepSpeed on LoRA, frozen and fully
fine-tuned transformers models (``tests/real/deepspeed/test_zero3_recompute_real.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

Record = Callable[[str, int], None]


def _to_tensors(function: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``apply_to_tensors_only`` (DeepSpeed 0.19.8 ``runtime/zero/utils.py:156-199``): ``function`` applied to each
    tensor in nested tuples, lists and dicts (a dict in place, as DeepSpeed does); anything else unchanged."""
    if isinstance(value, (tuple, list)):
        touched = [_to_tensors(function, element) for element in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return value.__class__(*touched)
        return value.__class__(touched)
    if isinstance(value, dict):
        for key in list(value):
            value[key] = _to_tensors(function, value[key])
        return value
    if isinstance(value, torch.Tensor):
        return function(value)
    return value


class _ModuleHooks:
    """One module's four hooks and the two counters DeepSpeed keeps on it (``applied_pre_backward_ref_cnt``,
    ``ds_grads_remaining``)."""

    def __init__(self, index: int, record: Record) -> None:
        self.index = index
        self.record = record
        self.pre_backward_count = 0
        self.grads_remaining = 0
        hooks = self

        class PreBackward(torch.autograd.Function):  # PreBackwardFunctionForModule, parameter_offload.py:466-484
            @staticmethod
            def forward(outputs: torch.Tensor) -> torch.Tensor:
                return outputs.detach()

            @staticmethod
            def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
                hooks.pre_backward_count += 1

            @staticmethod
            def backward(ctx: Any, *args: Any) -> Any:
                if hooks.pre_backward_count > 0:  # _run_before_backward_function, :456-463
                    hooks.record("backward_pre", hooks.index)
                    hooks.pre_backward_count -= 1
                return args

        class PostBackward(torch.autograd.Function):  # PostBackwardFunctionModule, :497-524
            @staticmethod
            def forward(output: torch.Tensor) -> torch.Tensor:
                return output.detach()

            @staticmethod
            def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
                if inputs[0].requires_grad:
                    hooks.grads_remaining += 1

            @staticmethod
            def backward(ctx: Any, *args: Any) -> Any:
                hooks.grads_remaining -= 1
                if hooks.grads_remaining == 0:  # _run_after_backward_function, :493-495
                    hooks.record("backward_post", hooks.index)
                return args

        self.pre_backward = PreBackward
        self.post_backward = PostBackward

    def pre_forward(self, module: nn.Module, args: Any) -> None:  # _pre_forward_module_hook, :359-360
        self.record("forward_pre", self.index)

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:  # _post_forward_module_hook, :363-402
        self.record("forward_post", self.index)

    def mark_outputs(self, module: nn.Module, args: Any, output: Any) -> Any:  # _pre_backward_module_hook, :410-414
        return _to_tensors(self.pre_backward.apply, output)

    def mark_inputs(self, module: nn.Module, args: Any) -> Any:  # _post_backward_module_hook, :437-442
        self.grads_remaining = 0
        return _to_tensors(self.post_backward.apply, args)


@contextlib.contextmanager
def deepspeed_module_events(modules: list[nn.Module], record: Record) -> Iterator[None]:
    """Every module of ``modules`` hooked as DeepSpeed's ZeRO-3 hooks it (module doc), ``record(kind, index)``
    called with ``forward_pre`` | ``forward_post`` | ``backward_pre`` | ``backward_post`` and the module's index in
    ``modules``; the hooks removed on exit."""
    handles = []
    for index, module in enumerate(modules):
        hooks = _ModuleHooks(index, record)
        handles.append(module.register_forward_pre_hook(hooks.pre_forward))  # :445, in this order
        handles.append(module.register_forward_hook(hooks.post_forward))  # :448
        handles.append(module.register_forward_hook(hooks.mark_outputs))  # :487
        handles.append(module.register_forward_pre_hook(hooks.mark_inputs))  # :528
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
