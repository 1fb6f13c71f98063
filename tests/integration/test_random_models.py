"""Property-based: random stacks of common modules, shapes and dtypes.

For every generated model memprof must agree with independent counts
(tests/helpers.py) and must not change any result.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import memprof
from memprof import Category as C

from helpers import (
    LiveBytes,
    buffer_bytes,
    grad_bytes,
    optimizer_state_bytes,
    saved_activation_bytes,
    weight_bytes,
)

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


class Conv1dSeq(nn.Module):
    """Conv1d over the sequence axis of a (batch, seq, dim) tensor."""

    def __init__(self, d, k):
        super().__init__()
        self.conv = nn.Conv1d(d, d, k, padding=k // 2)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


@st.composite
def stacks(draw):
    d = draw(st.integers(2, 24))
    layers = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["linear", "relu", "gelu", "layernorm", "dropout", "conv1d"]))
        if kind == "linear":
            d_out = draw(st.integers(2, 24))
            layers.append(("linear", d, d_out, draw(st.booleans())))
            d = d_out
        elif kind == "dropout":
            layers.append(("dropout", draw(st.sampled_from([0.0, 0.25]))))
        elif kind == "conv1d":
            layers.append(("conv1d", d, draw(st.sampled_from([1, 3]))))
        else:
            layers.append((kind,))
    return {
        "d_in": layers[0][1] if layers[0][0] in ("linear", "conv1d") else None,
        "layers": layers,
        "d_out": d,
        "batch": draw(st.integers(1, 4)),
        "seq": draw(st.integers(1, 6)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "optimizer": draw(st.sampled_from(["adamw", "sgd_momentum"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def build(spec, d_first):
    mods = []
    d = d_first
    for layer in spec["layers"]:
        kind = layer[0]
        if kind == "linear":
            mods.append(nn.Linear(d, layer[2], bias=layer[3]))
            d = layer[2]
        elif kind == "relu":
            mods.append(nn.ReLU())
        elif kind == "gelu":
            mods.append(nn.GELU())
        elif kind == "layernorm":
            mods.append(nn.LayerNorm(d))
        elif kind == "dropout":
            mods.append(nn.Dropout(layer[1]))
        elif kind == "conv1d":
            mods.append(Conv1dSeq(d, layer[2]))
    return nn.Sequential(*mods).to(spec["dtype"]), d


def first_dim(spec):
    # A stack may start with a shape-preserving layer; its width is then the first Linear's input.
    for layer in spec["layers"]:
        if layer[0] in ("linear", "conv1d"):
            return layer[1]
    return spec["d_out"]


def make_case(spec):
    torch.manual_seed(spec["seed"])
    model, d = build(spec, first_dim(spec))
    g = torch.Generator().manual_seed(spec["seed"])
    x = torch.randn(spec["batch"], spec["seq"], first_dim(spec), generator=g).to(spec["dtype"])
    target = torch.randn(spec["batch"], spec["seq"], d, generator=g).to(spec["dtype"])
    return model, x, target


def make_opt(spec, model):
    params = [p for p in model.parameters()]
    if spec["optimizer"] == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def loss_fn(out, target):
    return F.mse_loss(out.float(), target.float())


def run(spec, profiled):
    """Two training steps; returns (losses, params, report or None, independent figures)."""
    model, x, target = make_case(spec)
    opt = make_opt(spec, model)
    figures = {}
    torch.manual_seed(spec["seed"] + 1)  # dropout draws from here, with or without memprof

    def body(prof=None):
        losses = []
        for step in range(2):
            out = model(x)
            loss = loss_fn(out, target)
            del out
            loss.backward()
            if step == 0:
                figures["grads"] = grad_bytes(model)
            opt.step()
            if step == 0:
                figures["states"] = optimizer_state_bytes(opt)
            opt.zero_grad()
            losses.append(loss.detach().clone())
        return losses

    if not profiled:
        losses = body()
        return losses, [p.detach().clone() for p in model.parameters()], None, figures, model, x, target
    if not any(p.requires_grad for p in model.parameters()):
        raise AssertionError("every generated stack has parameters")
    counter = LiveBytes(list(model.parameters()) + list(model.buffers()) + [x, target])
    with counter:
        with memprof.profile(model, opt, mode="exact") as prof:
            losses = body(prof)
    counter.close()
    figures["live_peak"] = counter.peak
    return losses, [p.detach().clone() for p in model.parameters()], prof.report(), figures, model, x, target


def has_params(spec):
    return any(layer[0] in ("linear", "conv1d") or layer[0] == "layernorm" for layer in spec["layers"])


def assert_sums(bd):
    assert bd.total == sum(v for v in bd.counts if v is not None)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stacks())
def test_random_stacks_are_exact_and_change_nothing(spec):
    if not has_params(spec):
        spec = dict(spec, layers=[("linear", spec["d_out"], spec["d_out"], True)] + spec["layers"])
    l0, p0, _, f0, *_ = run(spec, profiled=False)
    l1, p1, rep, f1, model, x, target = run(spec, profiled=True)

    # Running under memprof changes no result, bit for bit (dropout included).
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))

    tr = rep.trace
    assert rep.num_steps == 2
    # Breakdowns sum to their totals; the global peak is the highest of everything.
    for bd in (tr.start, tr.peak, tr.end):
        assert_sums(bd)
    for rec in tr.phases:
        for bd in (rec.start, rec.peak, rec.end):
            assert_sums(bd)
            assert all(v >= 0 for v in bd.counts[:9])
        assert tr.peak.total >= rec.peak.total >= max(rec.start.total, rec.end.total)
    for s in tr.timeline:
        assert_sums(s.breakdown)
        assert tr.peak.total >= s.breakdown.total
    # The global peak equals an independent live-bytes counter over the same ops.
    assert tr.peak.total == f1["live_peak"]

    # Model states equal independent sums.
    w, b = weight_bytes(model), buffer_bytes(model)
    for step in (0, 1):
        end = rep.breakdown(step, "forward", "end")
        assert end[C.WEIGHTS] == w and end[C.BUFFERS] == b
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == f1["grads"] == w
    assert rep.breakdown(0, "optimizer", "end")[C.OPTIMIZER_STATES] == f1["states"]
    assert rep.breakdown(1, "optimizer", "end")[C.OPTIMIZER_STATES] == f1["states"]
    assert tr.end[C.GRADIENTS] == 0

    # Saved activations at the end of forward equal an independent saved-tensor count of the
    # same computation (model + loss), parameters and the two inputs excluded.
    expected = saved_activation_bytes(lambda: loss_fn(model(x), target),
                                      list(model.parameters()) + list(model.buffers()) + [x, target])
    assert rep.breakdown(1, "forward", "end")[C.ACTIVATIONS] == expected
    assert rep.breakdown(1, "backward", "end")[C.ACTIVATIONS] == 0


@settings(max_examples=10, deadline=None)
@given(stacks())
def test_random_stacks_light_mode_model_states(spec):
    if not has_params(spec):
        spec = dict(spec, layers=[("linear", spec["d_out"], spec["d_out"], True)] + spec["layers"])
    model, x, target = make_case(spec)
    opt = make_opt(spec, model)
    ref = copy.deepcopy(model)
    with memprof.profile(model, opt, mode="light") as prof:
        for _ in range(2):
            loss_fn(model(x), target).backward()
            g = grad_bytes(model)
            opt.step()
            opt.zero_grad()
    rep = prof.report()
    end = rep.breakdown(1, "optimizer", "end")
    assert end[C.WEIGHTS] == weight_bytes(model) == weight_bytes(ref)
    assert end[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt)
    assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == g
    assert end[C.TEMPORARIES] is None and end.total is None  # CPU light mode: not measured, never 0
