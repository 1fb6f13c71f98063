"""Checkpointing and backward attribution: recomputed tensors, each module's backward frame and peak,
against independent counts (tests/helpers.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import memprof
from memprof import Category as C

from helpers import (
    assert_sums,
    LiveBytes,
    hooks_left,
    saved_activation_bytes,
    weight_bytes,
)


# --------------------------------------------------------------- checkpointing


class CkptNet(nn.Module):
    """pre -> checkpointed block; ``how`` picks what is handed to checkpoint()."""

    def __init__(self, how, reentrant):
        super().__init__()
        self.how = how
        self.reentrant = reentrant
        self.pre = nn.Linear(64, 64)
        self.block = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))

    def forward(self, x):
        h = self.pre(x)
        b = self.block
        if self.how == "module":
            return checkpoint(b, h, use_reentrant=self.reentrant)
        if self.how == "lambda":
            return checkpoint(lambda t: b(t), h, use_reentrant=self.reentrant)
        # No module runs inside the checkpointed region at all.
        return checkpoint(lambda t: F.linear(F.gelu(F.linear(t, b[0].weight, b[0].bias)), b[2].weight, b[2].bias),
                          h, use_reentrant=self.reentrant)


def _ckpt_run(how, reentrant):
    torch.manual_seed(0)
    model = CkptNet(how, reentrant)
    x = torch.randn(128, 64)
    counter = LiveBytes(list(model.parameters()) + [x])
    with counter:
        with memprof.profile(model) as prof:
            model(x).sum().backward()
    counter.close()
    return model, x, prof.report(), counter.peak


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("how", ["module", "lambda", "functional"])
def test_checkpoint_of_any_callable_totals(how, reentrant):
    model, x, rep, live_peak = _ckpt_run(how, reentrant)
    # Forward keeps only the block input h = pre(x): 128*64*4 = 32768 B.
    assert saved_activation_bytes(lambda: model(x).sum(), list(model.parameters()) + [x]) == 32768
    assert rep.breakdown(0, "forward", "end")[C.ACTIVATIONS] == 32768
    assert rep.peak.total == live_peak
    assert rep.breakdown(0, "backward", "end")[C.ACTIVATIONS] == 0
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == weight_bytes(model)
    assert_sums(rep.breakdown(0, "backward", "peak"))
    assert hooks_left(model) == []


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_of_a_plain_function_counts_recomputed_tensors(reentrant):
    # Wrapping the same computation in a module or in a plain function must not change the categories.
    _, _, by_module, _ = _ckpt_run("module", reentrant)
    _, _, by_function, _ = _ckpt_run("functional", reentrant)
    a, b = by_module.breakdown(0, "backward", "peak"), by_function.breakdown(0, "backward", "peak")
    assert b.total == a.total
    assert b[C.ACTIVATIONS] == a[C.ACTIVATIONS]
    # At backward's peak the recomputed GELU input 128*512*4 = 262144 B is still held for backward,
    # as is h (32768 B).
    assert b[C.ACTIVATIONS] >= 262144 + 32768


# ----------------------------------------------------- backward attribution


def test_backward_peaks_of_a_chain():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(64, 32)
    with memprof.profile(model) as prof:
        model(x).sum().backward()
    mods = prof.report().modules()
    # ReLU's backward creates grad_input = threshold_backward(grad, result): 64*256*4 = 65536 B,
    # alive when the module's backward ends (it is the next module's output gradient).
    assert mods.loc["1", "peak_backward"] == 64 * 256 * 4
    # A container's backward spans its children's: its rise is at least each child's.
    for child in ("0", "1", "2"):
        assert mods.loc["<model>", "peak_backward"] >= mods.loc[child, "peak_backward"]


def test_backward_peak_of_a_module_whose_input_is_a_leaf():
    # The input requires grad and has no grad_fn: the module's backward ends at a tensor hook on it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU())
    x = torch.randn(64, 32, requires_grad=True)
    with memprof.profile(model) as prof:
        model(x).sum().backward()
    mods = prof.report().modules()
    # Linear's backward (AddmmBackward) makes grad_input 64*32*4 = 8192 B, grad_weight
    # 256*32*4 = 32768 B and grad_bias 256*4 = 1024 B while its frame is open: 41984 B.
    assert mods.loc["0", "peak_backward"] == 8192 + 32768 + 1024
    assert x.grad is not None and x.grad.shape == x.shape


class _SideBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(64, 8192)  # its weight's gradient is 8192*64*4 = 2 MiB
        self.body = nn.Linear(64, 64)
        self.head = nn.Linear(64, 64)

    def forward(self, x, x2):
        a = self.side(x2)  # made first: its backward runs last
        f = self.body(x)
        return self.head(f).sum() + a.sum(), f


def test_autograd_grad_stopping_at_a_module_input_closes_that_module_backward():
    # torch.autograd.grad(out, [f, ...]) captures f's gradient without running f.grad_fn; head's backward
    # must still end there, or the side branch's work would be charged to it.
    torch.manual_seed(0)
    model = _SideBranch()
    x, x2 = torch.randn(32, 64), torch.randn(32, 64)
    with memprof.profile(model) as prof:
        out, f = model(x, x2)
        torch.autograd.grad(out, [f, model.side.weight])
    rows = {m.path: m for m in prof.trace.modules}
    # head's backward makes only the gradient w.r.t. f, 32*64*4 = 8,192 B (its own weight and bias are
    # not asked for); the side branch's 8192*64*4 = 2,097,152 B weight gradient is side's.
    assert rows["head"].peak_backward == 32 * 64 * 4
    assert rows["side"].peak_backward == 8192 * 64 * 4


class _Halves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.proj(x).chunk(2, dim=-1)  # two outputs of one autograd node
        return a, b


def test_backward_frame_of_a_module_with_outputs_of_one_node():
    torch.manual_seed(0)
    model = _Halves()
    x = torch.randn(8, 16)
    with memprof.profile(model) as prof:
        a, b = model(x)
        (a * 2 + b).sum().backward()
    mods = prof.report().modules()
    # The model's backward starts once, when the split node's gradients are complete: both halves
    # (8*32*4 = 1024 B each) are then joined into the proj output's gradient, 8*64*4 = 2048 B.
    assert mods.loc["<model>", "peak_backward"] >= 2048
    assert mods.loc["<model>", "peak_backward"] >= mods.loc["proj", "peak_backward"] > 0


