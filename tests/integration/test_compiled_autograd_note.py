"""The compiled-autograd note appears only where compiled autograd ran, and counts the backwards it ran.

Gradients that no gradient hook of memprof's announced are not all compiled autograd's: FSDP2 gives the sharded
parameter its reduce-scattered gradient by assignment, a loop that takes torch.autograd.grad sets ``p.grad``
itself, and DTensor gradients were once taken for unannounced ones because they are not plain tensors. None of
those runs may blame compiled autograd; and a run that accumulates gradients under compiled autograd counts every
backward, each ending where the next forward begins.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memprof

from tests.integration.test_parallelize import IDS, build, fsdp_bf16, loss_fn, tp_sp

compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")

NOTE = "backward(s) made gradients that memprof's gradient hooks did not see"


def _notes(trace) -> list[str]:
    return [n for n in trace.notes if NOTE in n]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
@pytest.mark.parametrize("parallelize", [fsdp_bf16, tp_sp], ids=["fsdp2", "tp"])
def test_a_parallelize_function_is_not_taken_for_compiled_autograd(parallelize):
    est = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                           world_size=2, parallelize=parallelize)
    assert _notes(est.trace) == []


@pytest.mark.parametrize("mode", ["exact", "light"])
def test_gradients_set_by_hand_are_not_taken_for_compiled_autograd(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    params = list(model.parameters())
    with memprof.profile(model, opt, mode=mode) as prof:
        for _ in range(3):
            grads = torch.autograd.grad(model(x).square().mean(), params)
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
            opt.zero_grad()
    trace = prof.report().trace
    assert _notes(trace) == []
    # The gradients were still counted: at each step's optimizer phase, every parameter's gradient is alive,
    # (8*16 + 16 + 16*4 + 4) * 4 = 848 bytes.
    optimizer_phases = [p for p in trace.phases if p.phase.value == "optimizer"]
    assert len(optimizer_phases) == 3
    assert all(p.start["gradients"] == (8 * 16 + 16 + 16 * 4 + 4) * 4 == 848 for p in optimizer_phases)


@pytest.mark.parametrize("mode", ["exact", "light"])
def test_accumulation_under_compiled_autograd_counts_every_backward(mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 32)
    with memprof.profile(model, opt, mode=mode) as prof:
        for _ in range(2):  # 2 steps of 2 micro-batches: 4 backwards, all run by compiled autograd
            for _ in range(2):
                loss = model(x).square().mean()
                with compiled_autograd._enable(torch.compile(backend="eager")):
                    loss.backward()
            opt.step()
            opt.zero_grad()
    trace = prof.report().trace
    assert [n.split(" ", 1)[0] for n in _notes(trace)] == ["4"]
    kinds = [p.phase.value for p in trace.phases if p.phase.value in ("forward", "backward")]
    assert kinds == ["forward", "backward"] * 4
    # Each backward's gradients are counted where it ends (the next forward, or the step): Linear(32, 64) and
    # Linear(64, 8), (32*64 + 64 + 64*8 + 8) * 4 = 10,528 bytes, alive at the end of all four.
    grads = 4 * (32 * 64 + 64 + 64 * 8 + 8)
    assert grads == 10_528
    assert [p.end["gradients"] for p in trace.phases if p.phase.value == "backward"] == [grads] * 4
