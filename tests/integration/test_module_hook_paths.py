"""The module hooks' common path (the ledger's frame push and pop, the frame's close, the timeline sample and
the backward frames' tensor hooks written out in them): each module call's figures to the byte, the slower
paths (keyword and nested tensors, a frame not on top) the same, and the user's own hooks in their order."""

from __future__ import annotations

import torch
from torch import nn

import memprof

N = 100  # fp32 elements per tensor: 400 bytes


class _Scratch(nn.Module):
    """Makes two tensors of 400 B, frees the first, returns the second."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x + 1
        b = a * 2
        del a
        return b


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = _Scratch()
        self.second = _Scratch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _rows(prof) -> dict:
    return {m.path or "<model>": m for m in prof.trace.modules}


def test_forward_frames_rise_and_scratch_to_the_byte():
    model = _Two()
    x = torch.randn(N)
    with torch.no_grad(), memprof.profile(model) as prof:
        model(x)
    rows = _rows(prof)
    # Each _Scratch call: live bytes rise by a (400) + b (400) = 800 at its worst, and a is freed before its
    # end, so 400 of them were needed only while it ran.
    for path in ("first", "second"):
        assert (rows[path].peak_forward, rows[path].temporaries_forward) == (800, 400)
    # The container: first's b (400) stays while second runs (+800): 1,200 at its worst. When it ends only
    # second's b is left (first's b died with forward's frame): 1,200 - 400 = 800 needed only while it ran.
    assert (rows["<model>"].peak_forward, rows["<model>"].temporaries_forward) == (1200, 800)


class _Keyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)

    def forward(self, *, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Caller(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Keyword()

    def forward(self, pair: "tuple[torch.Tensor, torch.Tensor]") -> torch.Tensor:
        return self.inner(x=pair[0] * pair[1])


def test_a_module_handed_its_tensor_by_keyword_gets_its_backward_frame():
    # The keyword argument takes the slow walk over the call's arguments; the tuple one, the root's.
    torch.manual_seed(0)
    model = _Caller()
    a, b = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    with memprof.profile(model) as prof:
        model((a, b)).sum().backward()
    rows = _rows(prof)
    # inner's backward (its child lin's) makes lin's weight gradient (8 x 8 fp32 = 256 B) and the gradient of
    # its input (4 x 8 fp32 = 128 B): 384 B at its worst. At its end the weight gradient is still held, so
    # 384 - 256 = 128 B were needed only while it ran. inner's backward ends (a tensor hook on x) while lin's,
    # entered on the same gradient and ending on the same tensor, is still open: lin's high is inner's too.
    assert (rows["inner"].peak_backward, rows["inner"].temporaries_backward) == (8 * 8 * 4 + 4 * 8 * 4, 4 * 8 * 4)
    assert (rows["inner.lin"].peak_backward, rows["inner.lin"].temporaries_backward) == (384, 128)
    assert rows["inner"].calls == 1 and rows["<model>"].calls == 1


def test_user_hooks_run_in_their_order_and_their_results_count():
    def run(profiled: bool) -> "tuple[list[str], torch.Tensor]":
        torch.manual_seed(0)
        model = _Two()
        order: list[str] = []
        model.first.register_forward_pre_hook(lambda m, a: order.append("pre, before the block"))
        model.first.register_forward_hook(lambda m, a, o: order.append("post, before the block"))
        x = torch.randn(N)
        if profiled:
            with memprof.profile(model):
                handles = [model.first.register_forward_pre_hook(lambda m, a: order.append("pre, inside")),
                           # A hook that replaces the output: what the next module gets.
                           model.first.register_forward_hook(lambda m, a, o: o * 0)]
                out = model(x)
        else:
            handles = [model.first.register_forward_pre_hook(lambda m, a: order.append("pre, inside")),
                       model.first.register_forward_hook(lambda m, a, o: o * 0)]
            out = model(x)
        for h in handles:
            h.remove()
        return order, out

    order, out = run(profiled=True)
    bare_order, bare_out = run(profiled=False)
    assert order == bare_order == ["pre, before the block", "pre, inside", "post, before the block"]
    # second gets first's output times 0: (0 + 1) * 2 everywhere, with and without memprof.
    assert torch.equal(out, bare_out) and torch.equal(out, torch.full((N,), 2.0))


def test_hooks_made_once_per_module_are_gone_after_the_block():
    torch.manual_seed(0)
    model = _Caller()
    a, b = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    with memprof.profile(model):
        for _ in range(3):
            model((a, b)).sum().backward()
    # No hook of memprof's is left on the modules or on the leaf tensor handed in.
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks
    assert not a._backward_hooks
