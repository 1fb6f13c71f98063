"""CPU autocast and GradScaler in a real run: what autocast keeps (its weight casts, saved as activations)
and that GradScaler's steps are steps, against independent sums."""

from __future__ import annotations

import torch
from torch import nn

import memprof
from memprof import Category as C

from helpers import hooks_left, non_other, saved_activation_bytes, weight_bytes


def test_gradscaler_on_cpu_with_autocast():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(16, 64)
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    rep = prof.report()
    assert rep.num_steps == 2
    for s in prof.trace.steps:
        assert non_other(s) == [("forward", 0), ("backward", 0), ("optimizer", 0)]
    # Gradients have the parameters' dtype (fp32), not the autocast dtype.
    assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == weight_bytes(model)
    assert rep.trace.autocast_dtype == "bfloat16"
    assert hooks_left(model) == []


def test_autocast_bf16_weight_copies_are_activations():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    x = torch.randn(16, 64, requires_grad=True)

    def fwd():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().sum()

    expected = saved_activation_bytes(fwd, list(model.parameters()) + [x])
    # bf16 copies saved by mm: x 16*64*2 = 2048, W1 64*128*2 = 16384 (2 B/param), the ReLU
    # result 16*128*2 = 4096 (also Linear 2's mat1), W2 128*32*2 = 8192. Biases are not saved.
    assert expected == 2048 + 16384 + 4096 + 8192
    with memprof.profile(model) as prof:
        loss = fwd()
        loss.backward()
    rep = prof.report()
    fwd_end = rep.breakdown(0, "forward", "end")
    assert fwd_end[C.ACTIVATIONS] == expected
    assert fwd_end[C.WEIGHTS] == weight_bytes(model)  # the fp32 masters only
    assert rep.breakdown(0, "backward", "end")[C.ACTIVATIONS] == 0
