"""Model structures memprof must count exactly: tied weights, shared modules, a module used outside the model,
in-place ops and views, sparse gradients, complex and integer tensors, outputs and inputs of any shape.
Each figure is compared with an independent sum (tests/helpers.py) with the arithmetic in a comment.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C

from helpers import (
    LiveBytes,
    assert_sums,
    grad_bytes,
    hooks_left,
    optimizer_state_bytes,
    saved_activation_bytes,
    unique_bytes,
    weight_bytes,
)
from models import MLP


def test_tied_weights_with_optimizer_state_once():
    emb = nn.Embedding(20, 8)
    head = nn.Linear(8, 20, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    opt = torch.optim.Adam(model.parameters())
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            F.cross_entropy(model(torch.tensor([[1, 2, 3]])).flatten(0, 1), torch.tensor([4, 5, 6])).backward()
            opt.step()
            opt.zero_grad()
    rep = prof.report()
    # One 20x8 fp32 storage: 640 B of weights; Adam: 2 * 640 + one 4-byte step.
    assert rep.end[C.WEIGHTS] == 640
    assert rep.end[C.OPTIMIZER_STATES] == 2 * 640 + 4 == optimizer_state_bytes(opt)
    assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == 640


def test_shared_module_called_twice():
    lin = nn.Linear(16, 16)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(torch.relu(self.lin(x)))

    model = Twice()
    x = torch.randn(8, 16)
    expected = saved_activation_bytes(lambda: model(x).sum(), list(model.parameters()) + [x])
    assert expected == 8 * 16 * 4  # the ReLU result, saved by relu and by lin's second call
    with memprof.profile(model) as prof:
        model(x).sum().backward()
    rep = prof.report()
    assert rep.breakdown(0, "forward", "end")[C.ACTIVATIONS] == expected
    mods = rep.modules()
    assert mods.loc["lin", "calls"] == 2
    # Gradients of both calls accumulate into one (16*16+16)*4 = 1088 B.
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == mods.loc["lin", "gradients"] == 1088


def test_module_used_outside_the_model():
    model = nn.Linear(16, 16)
    ext = nn.Linear(16, 16)  # not part of the profiled model
    x = torch.randn(8, 16)

    def step():
        return ext(torch.relu(model(x))).sum()

    expected = saved_activation_bytes(step, list(model.parameters()) + list(ext.parameters()) + [x])
    assert expected == 8 * 16 * 4  # the ReLU result (relu and ext both save it)
    with memprof.profile(model) as prof:
        step().backward()
    rep = prof.report()
    fwd = rep.breakdown(0, "forward", "end")
    assert fwd[C.ACTIVATIONS] == expected  # counted in the totals...
    assert rep.modules().loc["<model>", "activations"] == 0  # ...but attributed to no module of the model
    assert fwd[C.WEIGHTS] == weight_bytes(model) == 1088  # ext's parameters are not the model's weights
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == 1088
    assert_sums(fwd)


def test_inplace_ops_and_views():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 32)
            self.b = nn.Linear(16, 4)

        def forward(self, x):
            h = self.a(x)
            h.relu_()
            v = h.view(8, 2, 16)[:, 0]
            t = v.clone().t_()
            return self.b(t.t() * 2)

    model = M()
    x = torch.randn(8, 16)
    expected = saved_activation_bytes(lambda: model(x).sum(), list(model.parameters()) + [x])
    # relu_ saves the mutated 8x32 buffer (1024 B); the clone of the view is 8x16 (512 B), the
    # product (mat1 of b) another 512 B; mul by a scalar saves nothing.
    assert expected == 1024 + 512
    counter = LiveBytes(list(model.parameters()) + [x])
    with counter:
        with memprof.profile(model) as prof:
            model(x).sum().backward()
    counter.close()
    rep = prof.report()
    assert rep.breakdown(0, "forward", "end")[C.ACTIVATIONS] == expected
    assert rep.peak.total == counter.peak


@pytest.mark.parametrize("opt_name", ["SparseAdam", "SGD"])
def test_sparse_embedding_gradients(opt_name):
    emb = nn.Embedding(100, 16, sparse=True)
    model = nn.Sequential(emb)
    opt = torch.optim.SparseAdam(list(model.parameters())) if opt_name == "SparseAdam" else \
        torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.tensor([[1, 2, 3, 2]])
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            model(idx).sum().backward()
            g = emb.weight.grad
            # A sparse COO gradient: int64 indices 1x4 (32 B) + values 4x16 fp32 (256 B).
            sparse_bytes = g._indices().untyped_storage().nbytes() + g._values().untyped_storage().nbytes()
            del g  # a gradient the user still holds after zero_grad is another matter (see below)
            opt.step()
            opt.zero_grad()
    assert sparse_bytes == 32 + 256
    rep = prof.report()
    assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == sparse_bytes
    # SparseAdam: dense exp_avg + exp_avg_sq (2 * 100*16*4 = 12800) + a step; SGD: nothing.
    assert rep.end[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt)
    # (SparseAdam keeps its step count as a Python int: no tensor.)
    assert rep.end[C.OPTIMIZER_STATES] == (12800 if opt_name == "SparseAdam" else 0)
    assert rep.end[C.WEIGHTS] == 6400
    assert hooks_left(model) == []


def test_gradient_kept_by_user_after_zero_grad_is_not_a_gradient():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    with memprof.profile(model, opt) as prof:
        F.cross_entropy(model(x), y).backward()
        kept = [p.grad for p in model.parameters()]  # e.g. for logging a gradient norm later
        opt.step()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    rep = prof.report()
    w = weight_bytes(model)
    assert unique_bytes(kept) == w
    start = rep.breakdown(1, "forward", "start")
    assert grad_bytes(model) == w  # the second backward's gradients
    # Before the second backward no parameter has a .grad: the kept tensors are ordinary ones.
    assert start[C.GRADIENTS] == 0
    assert start[C.TEMPORARIES] == w
    assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == w
    del kept


def test_complex_and_integer_tensors():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            c = torch.complex(h, h * 2)
            c = c * c
            i = torch.arange(8) * 3  # int64, no grad
            return c.abs().sum() + i.sum()

    model = M()
    x = torch.randn(4, 8)
    expected = saved_activation_bytes(lambda: model(x), list(model.parameters()) + [x])
    # complex64 4x8: 256 B, saved by the mul (once) and by abs (the product, another 256);
    # h (4x8 fp32, 128) is saved by complex(); h*2 (128) too.
    assert expected == 768
    counter = LiveBytes(list(model.parameters()) + [x])
    with counter:
        with memprof.profile(model) as prof:
            model(x).backward()
    counter.close()
    rep = prof.report()
    assert rep.breakdown(0, "forward", "end")[C.ACTIVATIONS] == expected
    assert rep.peak.total == counter.peak
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == weight_bytes(model) == 288


def test_models_returning_tuples_and_dicts():
    class Multi(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return h.relu(), {"a": h.tanh(), "b": [h.sigmoid()]}

    model = Multi()
    x = torch.randn(4, 8)
    expected = saved_activation_bytes(lambda: model(x), list(model.parameters()) + [x])
    assert expected == 3 * 4 * 8 * 4  # relu, tanh and sigmoid each save their 4x8 result
    with memprof.profile(model) as prof:
        a, d = model(x)
        (a.sum() + d["a"].sum() + d["b"][0].sum()).backward()
    rep = prof.report()
    assert rep.breakdown(0, "forward", "end")[C.ACTIVATIONS] == expected
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == weight_bytes(model)
    assert rep.modules().loc["<model>", "activations"] == expected


def test_dict_input_and_kwargs_are_inputs():
    class KW(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, batch, *, scale):
            return self.lin(batch["x"]) * scale

    model = KW()
    batch = {"x": torch.randn(4, 8)}
    scale = torch.tensor(2.0)
    with memprof.profile(model) as prof:
        model(batch, scale=scale).sum().backward()
    # x 4*8*4 = 128 B and the 0-dim fp32 scale (4 B)
    assert prof.report().breakdown(0, "forward", "end")[C.INPUTS] == 128 + 4
