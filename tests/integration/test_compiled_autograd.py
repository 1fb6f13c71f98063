"""Compiled autograd (``torch._dynamo.compiled_autograd``) runs the backward as a graph dynamo compiles, tracing the
hooks on it into the graph, where memprof's do nothing (they must not change a graph). Training stays bit-identical
in both modes, no hook is left behind, and the gradients that AccumulateGrad makes inside the graph, which no hook
of memprof's announced, are found at the step and counted as gradients at their backward's peak from when they were
made; the report says what it could not see."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memprof
from tests.helpers import grad_bytes, hook_registry, hooks_left

compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def _train(model, opt, x) -> None:
    for _ in range(STEPS):
        loss = model(x).square().mean()
        with compiled_autograd._enable(torch.compile(backend="eager")):
            loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("mode", ["exact", "light"])
def test_compiled_autograd_trains_identically_and_names_its_gradients(mode):
    torch._dynamo.reset()
    x = torch.randn(16, 32)
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters())
    _train(ref, ref_opt, x)

    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    before = hook_registry(model, [opt], [x])
    with memprof.profile(model, opt, mode=mode) as prof:
        _train(model, opt, x)
    after = hook_registry(model, [opt], [x])
    # The same counts as before, and no hook on what the steps made (the optimizer's state).
    assert hooks_left(model) == [] and {k: after[k] for k in before} == before
    assert all(v == 0 for k, v in after.items() if k not in before)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    for a, b in zip(ref_opt.state.values(), opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)

    # Every parameter's gradient is alive at the end of each backward (AccumulateGrad made them in the graph):
    # Linear(32, 64) 64 x 32 + 64 fp32, Linear(64, 8) 8 x 64 + 8: (2048 + 64 + 512 + 8) x 4 = 10,528 bytes, each
    # storage once (the independent sum over a backward's gradients, taken from the reference run's last one).
    loss = ref(x).square().mean()
    loss.backward()
    expected = grad_bytes(ref)
    assert expected == 4 * (64 * 32 + 64 + 8 * 64 + 8) == 10_528
    trace = prof.report().trace
    backwards = [p for p in trace.phases if p.phase.value == "backward"]
    assert len(backwards) == STEPS
    for rec in backwards:
        assert rec.end["gradients"] == expected
        # The peak comes after the gradients were made (the last op of the graph accumulates the first layer's),
        # and names them gradients, not temporaries.
        assert rec.peak["gradients"] == expected, rec.peak
    text = prof.report().to_text()
    if mode == "exact":
        assert f"{STEPS} backward(s) made gradients that memprof's gradient hooks did not see" in text
        assert "not measured" in text.split("Top modules")[1]  # the per-module backward column
