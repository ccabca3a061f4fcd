"""The trace's module events in DeepSpeed's order (launchers/trace/zero3_events.py), on small real models: what
torch's ModTracker reports differently is what DeepSpeed's hooks do not do. (The same against real DeepSpeed, event
for event: tests/real/deepspeed/test_zero3_recompute_real.py.)"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from launchers.trace.zero3_events import deepspeed_module_events


class Adapter(nn.Module):
    """A frozen base and a LoRA-like path: ``a`` feeds ``b``, ``b`` is the block's last op that saves a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.base.requires_grad_(False)
        self.a = nn.Linear(4, 2, bias=False)
        self.b = nn.Linear(2, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x)) * 0.5


class Model(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.block = Adapter()
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (checkpoint(self.block, x, use_reentrant=False) if self.recompute else self.block(x)).sum()


def _events(model: nn.Module, x: torch.Tensor) -> list[tuple[str, str]]:
    modules = list(model.modules())
    names = {i: name or "root" for i, (name, _) in enumerate(model.named_modules())}
    events: list[tuple[str, int]] = []
    with deepspeed_module_events(modules, lambda kind, index: events.append((kind, index))):
        model(x).backward()
    return [(kind, names[index]) for kind, index in events]


def test_a_recomputation_that_stops_early_ends_no_forward_and_backward_marks_run_in_graph_order():
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    plain, recomputed = _events(Model(False), x), _events(Model(True), x)
    forward = [e for e in plain if e[0].startswith("forward")]
    assert recomputed[:len(forward)] == forward  # the first forward is the same
    backward = recomputed[len(forward):]
    # the recomputation starts when b's backward unpacks what it saved, and stops inside b (its last save):
    # block, base, a and b start their forward again, b and the block around it never end it (DeepSpeed's forward
    # hook is a plain one; torch's ModTracker, always_call, would end both)
    assert [e for e in backward if e[0] == "forward_pre"] == [("forward_pre", n) for n in
                                                              ("block", "block.base", "block.a", "block.b")]
    assert [e for e in backward if e[0] == "forward_post"] == [("forward_post", "block.base"),
                                                               ("forward_post", "block.a")]
    # b's input is a's output: b's backward ends (its mark on that input) before a's starts (its mark on the same
    # tensor, one node further), as DeepSpeed's two autograd functions order them
    assert backward.index(("backward_post", "block.b")) < backward.index(("backward_pre", "block.a"))
    # the frozen base's input needs a gradient (x does): its backward ends too
    assert ("backward_post", "block.base") in backward
    assert backward[-1] == ("backward_post", "root")


def test_inputs_passed_by_keyword_get_no_end_of_backward_and_gradients_pass_unchanged():
    class ByKeyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(input=x).sum()

    torch.manual_seed(0)
    model, x = ByKeyword(), torch.randn(3, 4, requires_grad=True)
    events = _events(model, x)
    assert ("backward_pre", "inner") in events and ("backward_post", "inner") not in events  # DeepSpeed marks args only
    assert ("backward_post", "root") in events
    expected = torch.autograd.grad(ByKeyword.forward(model, x), x)[0]
    with deepspeed_module_events(list(model.modules()), lambda kind, index: None):
        got = torch.autograd.grad(model(x), x)[0]
    torch.testing.assert_close(got, expected)  # the marks pass gradients through unchanged
    assert not model.inner._forward_hooks and not model.inner._forward_pre_hooks  # removed on exit
