"""Many profiling sessions in one process: memprof must leave nothing behind."""

import gc

import pytest
import tracemalloc
import weakref

import torch
import torch.nn.functional as F
import torch.optim.optimizer as optmod

import memprof

from helpers import hooks_left
from models import MLP


def _session(refs, mode):
    model = MLP(8, 16, 4)
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with memprof.profile(model, opt, mode=mode) as prof:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert hooks_left(model) == []
    assert prof.report().peak[memprof.Category.WEIGHTS] > 0
    refs.extend([weakref.ref(model), weakref.ref(opt), weakref.ref(x), weakref.ref(prof)])
    refs.extend(weakref.ref(p) for p in model.parameters())


def test_hundred_sessions_leave_nothing_behind():
    refs: list = []
    for i in range(100):
        _session(refs, "full" if i % 2 else "light")
    gc.collect()
    assert all(r() is None for r in refs), sum(r() is not None for r in refs)
    assert not optmod._global_optimizer_pre_hooks and not optmod._global_optimizer_post_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert torch._C._len_torch_dispatch_stack() == 0
    assert len(memprof.profiler._ACTIVE_MODELS) == 0


def _plain_session(refs, mode):
    model = MLP(8, 16, 4)
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _growth(session, n):
    refs: list = []
    for i in range(5):  # warm-up: lazy imports, per-op caches
        session(refs, "full")
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(n):
            session(refs, "full")
        refs.clear()
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    return sum(s.size_diff for s in after.compare_to(before, "filename"))


@pytest.mark.xfail(strict=True, reason="possible memprof leak (not root-caused): ~2 KB of Python memory per session "
                                        "stays allocated beyond what the same steps retain without memprof")
def test_sessions_retain_no_python_memory():
    # torch itself retains a little per new model/optimizer (about 600 B a session here, measured
    # without memprof), so memprof is judged against the same steps run without it.
    # Slack: 8 KiB over 20 sessions, i.e. < 410 B a session, below one retained Entry + weakref each.
    n = 20
    with_memprof = _growth(_session, n)
    without = _growth(_plain_session, n)
    assert with_memprof - without < 8 * 1024, (with_memprof, without)
