"""Carried optimizer steps behind wrappers and layouts: accelerate's optimizer is carried with the records measuring
gives; FSDP2's DTensor parameters and ZeroRedundancyOptimizer's nested step are measured every step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memprof

STEPS = 5


def _kinds(report) -> dict[int, str]:
    return {s: kind for a, b, kind in report.trace.optimizer_steps for s in range(a, b + 1)}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def test_accelerates_optimizer_is_carried_with_the_measured_records():
    accelerate = pytest.importorskip("accelerate")

    def run(carry):
        accelerator = accelerate.Accelerator(cpu=True)
        model = _mlp()
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        records = []
        with memprof.profile(model, opt, carry_optimizer_steps=carry) as prof:
            for i in range(STEPS):
                x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
                accelerator.backward(model(x).pow(2).sum())
                opt.step()  # AcceleratedOptimizer.step(closure=None): the AdamW inside it steps
                opt.zero_grad()
                prof.end_step()
                records.append(prof.latest_step())
        return prof.report(), records

    (carried, a), (_, b) = run(True), run(False)
    assert _kinds(carried) == {0: "measured", 1: "measured", 2: "carried", 3: "carried", 4: "carried"}
    assert a == b


def test_dtensor_parameters_are_measured_every_step(fake_world_of_two):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    model = _mlp()
    for m in (model[0], model[2], model):
        fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with memprof.profile(model, opt, mode="exact") as prof:
        for _ in range(STEPS):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    # DTensor parameters, gradients and state: a step memprof does not verify exact when carried is measured.
    assert prof.report().trace.optimizer_steps == ((0, STEPS - 1, "measured"),)


def test_a_step_that_nests_another_is_measured_every_step(fake_world_of_two):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _mlp()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    with memprof.profile(model, opt, mode="exact") as prof:
        for _ in range(STEPS):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()  # ZeroRedundancyOptimizer.step steps its local SGD inside its own step
            opt.zero_grad()
    assert prof.report().trace.optimizer_steps == ((0, STEPS - 1, "measured"),)
