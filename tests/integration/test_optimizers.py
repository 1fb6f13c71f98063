"""Optimizers memprof is given or meets: wrappers followed to the torch optimizer, one recreated inside
the block, state loaded inside it, a step with a closure; each measured exactly, training unchanged."""

from __future__ import annotations


import pytest
import torch
from torch import nn

import memprof
from memprof import Category as C
from memprof.errors import InvalidArgumentError

from helpers import optimizer_state_bytes, weight_bytes
from training import profile_or_not, seeded_mlp, train_square_sum




class Wrapped:
    """What accelerate (``.optimizer``) and Lightning (``._optimizer``) hand a training loop."""

    def __init__(self, opt, attr):
        setattr(self, attr, opt)
        self._attr = attr

    def step(self):
        getattr(self, self._attr).step()

    def zero_grad(self):
        getattr(self, self._attr).zero_grad()

    @property
    def param_groups(self):
        return getattr(self, self._attr).param_groups


@pytest.mark.parametrize("attr", ["optimizer", "_optimizer"])
def test_optimizer_wrappers_are_followed_to_the_torch_optimizer(attr):
    model, x = seeded_mlp(), torch.randn(8, 16)
    inner = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, Wrapped(Wrapped(inner, attr), attr)) as prof:
        train_square_sum(model, Wrapped(inner, attr), x)
    rep = prof.report()
    assert rep.num_steps == 3
    # exp_avg + exp_avg_sq (fp32, as the 676 weights) + a 4-byte step per tensor: 2 * 2,704 + 4 * 4 = 5,424 B.
    assert rep.end[C.OPTIMIZER_STATES] == optimizer_state_bytes(inner) == 2 * weight_bytes(model) + 16 == 5424


def test_accelerates_optimizer_is_followed():
    accelerate = pytest.importorskip("accelerate")
    model, x = seeded_mlp(), torch.randn(8, 16)
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    with memprof.profile(model, opt) as prof:
        for _ in range(3):
            accelerator.backward(model(x).pow(2).sum())
            opt.step()
            opt.zero_grad()
    rep = prof.report()
    assert rep.num_steps == 3
    assert rep.end[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt.optimizer) == 5424


def test_something_else_as_optimizer_is_refused_with_the_fix():
    with pytest.raises(InvalidArgumentError, match="AcceleratedOptimizer"):
        memprof.profile(seeded_mlp(), object())


def test_an_optimizer_recreated_inside_the_block_is_measured_and_named():
    model, x = seeded_mlp(), torch.randn(8, 16)
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.profile(model, first) as prof:
        train_square_sum(model, first, x, steps=1)
        second = torch.optim.Adam(model.parameters())
        train_square_sum(model, second, x, steps=2)
    rep = prof.report()
    assert rep.num_steps == 3
    assert rep.end[C.OPTIMIZER_STATES] == optimizer_state_bytes(second) == 5424
    assert any("Adam not passed to profile()" in n and "step 1" in n for n in rep.trace.notes)


def test_adam_step_counters_are_in_the_peak():
    model, x = seeded_mlp(), torch.randn(8, 16)
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt) as prof:
        train_square_sum(model, opt, x, steps=1)
    rep = prof.report()
    # The first step's peak is inside step(): exp_avg, exp_avg_sq and the four 4-byte counters are live.
    assert rep.breakdown(0, "optimizer", "peak")[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt) == 5424


def test_optimizer_state_loaded_inside_the_block_is_optimizer_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    saved = {"state": {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()},
             "param_groups": opt.state_dict()["param_groups"]}
    opt.zero_grad()
    with memprof.profile(model, opt, mode="exact") as prof:
        opt.load_state_dict(saved)  # casts and copies the loaded tensors: new storages
        model(torch.randn(2, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    # exp_avg + exp_avg_sq per parameter (2 x 1,188 fp32 elements) + one step counter per parameter.
    assert prof.report().end[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt)


def _closure_steps(mode, optimizer_cls):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = optimizer_cls(model.parameters())
    x = torch.randn(4, 8)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    with profile_or_not(model, opt, mode) as prof:
        losses = [opt.step(closure).item() for _ in range(3)]
    return losses, [p.detach().clone() for p in model.parameters()], prof


@pytest.mark.parametrize("optimizer_cls", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                           lambda ps: torch.optim.LBFGS(ps, max_iter=3)])
def test_a_step_with_a_closure_trains_identically_and_its_phases_are_in_order(optimizer_cls):
    plain = _closure_steps(None, optimizer_cls)
    losses, params, prof = _closure_steps("exact", optimizer_cls)
    assert losses == plain[0] and all(torch.equal(a, b) for a, b in zip(plain[1], params))
    for step in prof.trace.steps:
        kinds = [p.phase.value for p in step.phases if p.phase.value != "other"]
        # Forward and backward run inside step(closure) (LBFGS calls it several times); the optimizer's
        # own work comes after each closure, never before the first forward.
        assert kinds[:2] == ["forward", "backward"] and kinds[-1] == "optimizer"
