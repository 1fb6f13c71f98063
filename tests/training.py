"""The training loop the tests profile: forward, loss, backward, optimizer step, zero_grad.

One loop, so that a test that runs "N plain steps" runs the same steps as every other: the order of
the calls decides which phase each storage is born in, and a private copy that drifted (zero_grad
before the step, a batch freed earlier) would measure something else under the same name. Tests
whose loop differs in a way that matters (closures, autocast around the loss, gradient accumulation,
explicit steps, work between the calls) keep their own, with a comment saying why.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import memprof


def cross_entropy(out, y):
    return F.cross_entropy(out, y)


def output_sum(out, _y):
    """For a test that only needs a backward: the sum of the outputs, no target."""
    return out.sum()


def square_sum(out, _y):
    """For a test that needs gradients that depend on the outputs, without a target."""
    return out.pow(2).sum()


def _loss_of(model, batch, loss):
    # The batch is this frame's: once the loss is returned only autograd holds it, as in
    # ``model(torch.randn(...)).sum().backward()``.
    x, y = batch
    return loss(model(x), y)


def train(model, opt, batch: Any, *, steps: int = 2, loss: Callable = cross_entropy, zero_grad: bool = True,
          set_to_none: bool = True, keep_batch: bool = True) -> Any:
    """``steps`` training steps: ``loss(model(x), y).backward()``, ``opt.step()``,
    ``opt.zero_grad(set_to_none=set_to_none)`` (skipped with ``zero_grad=False``; with ``opt`` None
    there is neither step nor zero_grad, and memprof makes each backward a step).

    ``batch`` is ``(x, y)`` (``y`` None when the loss takes none), or a callable ``step -> (x, y)``
    making each step's batch inside the loop. A made batch is held, as a loop variable is, until
    the next one is made, and the last one is returned for the caller to hold; with
    ``keep_batch=False`` each one is a temporary of its step, freed once autograd lets it go.
    """
    held = None
    for i in range(steps):
        if not callable(batch):
            loss(model(batch[0]), batch[1]).backward()
        elif keep_batch:
            held = batch(i)  # the previous batch is let go only once this one exists
            loss(model(held[0]), held[1]).backward()
        else:
            _loss_of(model, batch(i), loss).backward()
        if opt is not None:
            opt.step()
            if zero_grad:
                # The plain call when freeing (torch's default): wrappers of optimizers may take no argument.
                opt.zero_grad() if set_to_none else opt.zero_grad(set_to_none=False)
    return held


def profile_training(model, opt, batch: Any, *, steps: int = 2, loss: Callable = cross_entropy,
                     zero_grad: bool = True, set_to_none: bool = True, keep_batch: bool = True,
                     **profile_kwargs: Any) -> "memprof.Report":
    """:func:`train` inside ``memprof.profile(model, opt, **profile_kwargs)``; the report.

    The last batch made stays alive until the block has ended, as a loop variable of the block's
    frame would: the run's end breakdown holds it as inputs."""
    with memprof.profile(model, opt, **profile_kwargs) as prof:
        last = train(model, opt, batch, steps=steps, loss=loss, zero_grad=zero_grad, set_to_none=set_to_none,
                     keep_batch=keep_batch)
    del last
    return prof.report()


def seeded_mlp():
    """Linear(16, 32), Tanh, Linear(32, 4), seeded: two builds hold the same weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def train_square_sum(model, opt, x, steps=3):
    """:func:`train` on ``x`` with the output's squares summed as the loss."""
    train(model, opt, (x, None), steps=steps, loss=square_sum)


def profile_or_not(model, opt=None, mode=None):
    """``memprof.profile(model, opt, mode=mode)``, or no profile at all when ``mode`` is None (the same code run
    bare, to compare with)."""
    return memprof.profile(model, opt, mode=mode) if mode else contextlib.nullcontext()
