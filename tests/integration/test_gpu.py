"""CUDA checks: run only with a GPU (skipped, never passed, without one)."""

import pytest
import torch
import torch.nn.functional as F

import memprof
from memprof import Category as C

from models import MLP

pytestmark = pytest.mark.gpu


def _step(model, opt, x, y):
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def test_exact_mode_matches_cuda_allocated_at_phase_ends():
    torch.cuda.synchronize()
    model = MLP(512, 2048, 10).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(256, 512, device="cuda"), torch.randint(0, 10, (256,), device="cuda")
    with memprof.profile(model, opt, mode="exact") as prof:
        _step(model, opt, x, y)
        _step(model, opt, x, y)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
    rep = prof.report()
    assert rep.trace.device.rounding == 512
    end = rep.end
    # Every tensor memprof counts is a 512-byte-rounded CUDA block; the allocator may hold a few more
    # (cuBLAS workspaces are not tensors), so memprof's sum is at most what torch reports.
    tensor_sum = sum(end[c] for c in (C.WEIGHTS, C.BUFFERS, C.GRADIENTS, C.OPTIMIZER_STATES,
                                      C.ACTIVATIONS, C.INPUTS, C.TEMPORARIES))
    assert tensor_sum <= allocated
    assert end[C.ALLOCATOR_OVERHEAD] is not None
    assert end.total == sum(v for v in end.values() if v is not None)


def test_light_mode_measures_temporaries_on_cuda():
    model = MLP(512, 2048, 10).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(256, 512, device="cuda"), torch.randint(0, 10, (256,), device="cuda")
    with memprof.profile(model, opt, mode="light") as prof:
        _step(model, opt, x, y)
        _step(model, opt, x, y)
    peak = prof.report().breakdown(1, "backward", "peak")
    assert peak[C.TEMPORARIES] is not None
    assert peak.total is not None and peak.total > 0


def test_a_cuda_oom_is_caught_at_the_failing_allocation(tmp_path):
    model = MLP(64, 64, 10).cuda()
    free, total = torch.cuda.mem_get_info()
    too_much = total + (1 << 30)  # more than the device has: the allocator's OOM observer fires
    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            with memprof.profile(model, oom_dump=tmp_path) as prof:
                model(torch.randn(8, 64, device="cuda")).sum().backward()
                torch.empty(too_much, dtype=torch.uint8, device="cuda")
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    oom = memprof.load(prof.oom_dump_path).trace.oom
    # The observer reports the allocator's request (the size rounded up to its block granularity).
    assert too_much <= oom.requested < too_much + (2 << 20)
    assert oom.device_free is not None and oom.device_total == torch.cuda.get_device_properties(0).total_memory
    assert oom.snapshot and (tmp_path / oom.snapshot).exists()
    # The snapshot's blocks at the parameters' addresses are the weights, each rounded to 512 bytes.
    frame = memprof.load(prof.oom_dump_path).attribute_snapshot(tmp_path / oom.snapshot)
    weights = frame[frame.category == "weights"]["size"].sum()
    assert weights >= sum(-(-p.untyped_storage().nbytes() // 512) * 512 for p in model.parameters())
