"""torch.func inside a profile: transforms run as without memprof (torch forbids saved-tensor hooks inside
them), between training steps and between a forward and its backward."""

from __future__ import annotations


import pytest
import torch
from torch import nn

import memprof
from memprof import Category as C

from training import profile_or_not, seeded_mlp, train_square_sum

MODES = ("exact", "light")




@pytest.mark.parametrize("mode", MODES)
def test_torch_func_runs_as_without_memprof(mode):
    from torch.func import functional_call, grad, vmap

    model, x = seeded_mlp(), torch.randn(5, 16)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi):
        return functional_call(model, p, (xi.unsqueeze(0),)).pow(2).sum()

    plain = vmap(grad(loss), in_dims=(None, 0))(params, x)
    with memprof.profile(model, mode=mode) as prof:
        profiled = vmap(grad(loss), in_dims=(None, 0))(params, x)
    assert all(torch.equal(plain[k], profiled[k]) for k in plain)
    rep = prof.report()
    assert rep.peak[C.ACTIVATIONS] is None and rep.peak[C.TEMPORARIES] is None
    assert any("torch.func transforms" in n for n in rep.trace.notes)


def test_torch_func_between_steps_of_ordinary_training():
    from torch.func import functional_call, grad

    model, x = seeded_mlp(), torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.profile(model, opt) as prof:
        train_square_sum(model, opt, x, steps=1)
        params = {k: v.detach() for k, v in model.named_parameters()}
        grad(lambda p: functional_call(model, p, (x,)).sum())(params)
        train_square_sum(model, opt, x, steps=1)
    assert prof.report().num_steps >= 2


@pytest.mark.parametrize("mode", MODES)
def test_torch_func_after_the_forward_inside_a_step(mode):
    # A torch.func transform between the model's forward and its backward: functorch refuses to run
    # under saved-tensor hooks, so memprof's hooks must only be pushed while a module runs.
    from torch.func import jacrev

    def train(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(6, 8)
        with profile_or_not(model, opt, mode):
            for _ in range(2):
                loss = model(x).pow(2).mean()
                jac = jacrev(lambda z: torch.tanh(z).sum(-1))(x)
                (loss + 1e-3 * jac.pow(2).sum()).backward()
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    plain = train(None)
    assert all(torch.equal(a, b) for a, b in zip(plain, train(mode)))
