"""A parallel estimate leaves the process as it found it: torch's ``init_process_group`` wraps ``sys.excepthook``
to prefix the rank to tracebacks, and a simulation's fake process group must not leave that behind."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

import memprof


def _split(model: nn.Module, k: int, n: int) -> nn.Module:
    return nn.Sequential(*list(model.children())[k * 2:(k + 1) * 2])


def test_a_pipeline_estimate_puts_the_excepthook_back():
    def mine(*args):  # a user's own hook, installed before the estimate
        return sys.__excepthook__(*args)

    before = sys.excepthook
    sys.excepthook = mine
    try:
        m = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        est = memprof.estimate(m, torch.optim.AdamW(m.parameters()), inputs=torch.randn(8, 8),
                               targets=torch.randn(8, 8), loss_fn=F.mse_loss, world_size=2, mesh={"pp": 2},
                               pipeline=memprof.Pipeline(_split, "1f1b", 2))
        assert est.peak_bytes > 0
        assert sys.excepthook is mine
    finally:
        sys.excepthook = before
