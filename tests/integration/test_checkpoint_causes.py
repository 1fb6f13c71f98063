"""Activation checkpointing has named causes in reconcile(): what checkpointed regions would have saved,
what they keep instead (their inputs), and what their recomputation holds in backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import memprof

from training import profile_training


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.act, self.b = nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 64)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


class _Net(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.reentrant = reentrant

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x.sum()


def _run(reentrant):
    torch.manual_seed(0)
    model = _Net(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # A batch large enough that backward peaks while a block is recomputed (its hidden activations
    # outweigh the weights' gradients).
    x = torch.randn(512, 64, requires_grad=True)
    return profile_training(model, opt, (x, None), loss=lambda out, _y: out)  # the model returns its loss


def _activation_causes(rec):
    return {c.name: c.bytes for c in rec.explanations if c.category.value == "activations"}


def test_non_reentrant_checkpointing_is_explained_at_the_end_of_forward():
    rec = _run(reentrant=False).reconcile(at=(-1, "forward", "end"))
    causes = _activation_causes(rec)
    row = rec.row("activations")
    # Every leaf module ran under checkpoint: the per-module formula's whole count is not kept...
    assert causes["activation checkpointing: saves not kept"] == -row.formula
    # ...and the regions keep their inputs instead: blocks 1 and 2 keep 512 x 64 fp32 inputs
    # (2 * 131,072 bytes); block 0's input is the model's own input, counted as an input.
    assert causes["activation checkpointing: region inputs"] == 2 * 512 * 64 * 4 == row.measured
    assert "unexplained" not in causes


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_recomputation_in_backward_is_named_and_nothing_is_left_unexplained(reentrant):
    report = _run(reentrant)
    rec = report.reconcile(at="peak")
    assert rec.where.startswith("peak (step 1, backward")
    causes = _activation_causes(rec)
    assert causes.get("activation checkpointing: recomputed in backward", 0) > 0
    assert "unexplained" not in causes
    # The causes add up to the gap, to the byte.
    row = rec.row("activations")
    assert row.formula + sum(causes.values()) == row.measured


def test_without_checkpointing_there_is_no_such_cause():
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.profile(model, opt) as prof:
        model(torch.randn(512, 64)).sum().backward()
        opt.step()
    names = _activation_causes(prof.report().reconcile(at=(0, "forward", "end")))
    assert not any(n.startswith("activation checkpointing") for n in names)
