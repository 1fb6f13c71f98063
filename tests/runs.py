"""Small runs profiled for real on CPU that several test files read (the HTML report, plots, diffs).

tests/integration/conftest.py holds them as module-scoped fixtures (``mlp8``, ``mlp16``, ``light8``,
``root_ops``); a test that needs a variant (one step, no timeline) calls :func:`run_mlp` itself.
"""

from __future__ import annotations

import torch
from torch import nn

import memprof

from models import MLP
from training import profile_training


class RootOps(nn.Module):
    """Saves a tensor in its own forward (the tanh output), so "<model>" has an own-ops row."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        # tanh saves its output t (the root's own activation); fc2 saves t * 2, another storage.
        return self.fc2(torch.tanh(self.fc1(x)) * 2)


def run_mlp(batch: int, steps: int = 2, mode: str = "exact", timeline: bool = True) -> memprof.Report:
    """The default MLP under SGD, ``steps`` steps of ``batch`` samples; every batch is made before the
    profile and stays alive in a list, so each is counted as inputs for the whole run."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(batch, 32), torch.randint(0, 10, (batch,))) for _ in range(steps)]
    return profile_training(model, opt, lambda i: batches[i], steps=steps, mode=mode, timeline=timeline)


def run_root_ops() -> memprof.Report:
    """One AdamW step of :class:`RootOps` (no zero_grad: the gradients stay to the end)."""
    torch.manual_seed(0)
    model = RootOps()
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt) as prof:
        x = torch.randn(4, 16)
        model(x).square().mean().backward()
        opt.step()
    return prof.report()
