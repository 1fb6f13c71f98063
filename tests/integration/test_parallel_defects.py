"""Two defects of one-rank estimates and measured data-parallel runs, each against the run it describes.

- The first optimizer step of an FSDP (or ZeRO) estimate: AdamW makes its state like the whole parameters
  inside ``step()``; the rank keeps its shard. The state was a temporary at the step's peak at its whole
  size, so it must leave the temporaries at that size, not at the shard's.
- DDP's Reducer copies its buckets into ``.grad`` in a backward callback queued after memprof's: those copies
  belong to the one backward phase, not to a second, empty one.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memprof
from memprof import Category as C

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])


def _peaks(rep):
    return {(p.step, p.phase.value): p.peak for p in rep.trace.phases if p.phase.value != "other"}


def test_the_first_optimizer_step_of_an_fsdp_estimate_is_the_ranks(fake_world_of_two):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    model = _stack()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(1, 256)
    with memprof.profile(model, opt) as prof:
        for _ in range(2):  # the loss held through the step and released when the loop ends, as the estimate's loop holds it
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        del loss
    measured = prof.report()
    plain = _stack()
    est = memprof.estimate(plain, torch.optim.AdamW(plain.parameters()), inputs=x, world_size=2, parallel="fsdp")
    # Before the fix the estimate peaked at 5,527,104 B in step 0's optimizer step: its temporaries were
    # 1,315,328 B against 262,656 B measured, the excess being (whole - shard) of exp_avg and exp_avg_sq, i.e.
    # 2 x 526,336 B = 1,052,672 B = the rank's shard bytes (8 x (256 x 256 + 256) x 4 / 2). (Both runs also hold
    # the loop's 4-byte loss through the step.)
    assert (measured.peak.total, measured.trace.peak_step, measured.trace.peak_phase.value) == (5_004_360, 1,
                                                                                               "backward")
    assert (est.peak_bytes, est.trace.peak_step, est.trace.peak_phase.value) == (5_004_360, 1, "backward")
    m, e = _peaks(measured), _peaks(est.report())
    for key in m:
        if key[1] == "optimizer":  # the state the step makes, at the step's peak, in every category
            assert e[key] == m[key], key
    # The step's own temporaries, 262,656 B, and the held loss, a 4-byte fp32 scalar.
    assert e[(0, "optimizer")][C.TEMPORARIES] == m[(0, "optimizer")][C.TEMPORARIES] == 262_656 + 4


@pytest.mark.parametrize("parallel", ["zero1", "zero2", "zero3"])
def test_a_zero_estimates_first_step_keeps_no_whole_state_in_its_temporaries(parallel):
    # ZeRO's estimates resize the state in the same hook: the first step's optimizer peak must not exceed the
    # second's, whose state was the rank's from the start (same temporaries, same shards).
    plain = _stack()
    est = memprof.estimate(plain, torch.optim.AdamW(plain.parameters()), inputs=torch.randn(1, 256), world_size=2,
                           parallel=parallel)
    p = _peaks(est.report())
    assert p[(0, "optimizer")][C.TEMPORARIES] == p[(1, "optimizer")][C.TEMPORARIES]


def test_ddp_has_one_backward_phase_per_step():
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)))
        opt = torch.optim.AdamW(model.parameters())
        with memprof.profile(model, opt) as prof:
            for _ in range(2):
                model(torch.randn(4, 64)).sum().backward()
                opt.step()
                opt.zero_grad()
    finally:
        dist.destroy_process_group()
    phases = [(p.step, p.phase.value, p.occurrence) for p in prof.report().trace.phases]
    for step in (0, 1):
        backwards = [ph for ph in phases if ph[0] == step and ph[1] == "backward"]
        assert backwards == [(step, "backward", 0)], phases
    # The Reducer's bucket -> .grad copies ran in that one backward: the gradients exist at its end.
    b = next(p for p in prof.report().trace.phases if p.step == 1 and p.phase.value == "backward")
    grads = sum(p.numel() * p.element_size() for p in model.parameters())  # (64*64 + 64 + 64*8 + 8) * 4 = 18,720
    assert b.end[C.GRADIENTS] == grads == 18_720
