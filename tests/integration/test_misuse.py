"""Faults and misuse: an OOM or an exception in the middle of a step, results bit-identical with
dropout, and every misuse refused with a MemprofError that names the fix.

Every test asserts an exact figure against an independent count (tests/helpers.py, plain sums,
arithmetic in the comments) or that a misuse is refused naming the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C
from memprof.errors import (
    InvalidArgumentError,
    MemprofError,
    NotMeasuredError,
    ProfilerStateError,
    UnknownNameError,
)

from helpers import (
    assert_sums,
    hooks_left,
    saved_activation_bytes,
    weight_bytes,
)
from models import MLP


OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)"


# ------------------------------------------------------------------------- faults


class ForwardBoom(nn.Module):
    """Allocates 1000 x 1000 fp32 (4,000,000 B) of scratch, then fails like an OOM."""

    def __init__(self):
        super().__init__()
        self.err = RuntimeError(OOM)

    def forward(self, x):
        scratch = torch.empty(1000, 1000)  # noqa: F841  (alive in the traceback's frame)
        raise self.err


def test_oom_mid_forward_is_explained():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), ForwardBoom())
    x = torch.randn(16, 32)
    # What autograd holds when module "3" fails: the ReLU result 16*64*4 = 4096 B
    # (saved by ReLU and as Linear "2"'s mat1: one storage). Linear "0" saves x, an input.
    expected_saved = saved_activation_bytes(lambda: model[:3](x), list(model.parameters()) + [x])
    assert expected_saved == 4096
    with pytest.raises(RuntimeError) as info:
        with memprof.profile(model) as prof:
            model(x)
    assert info.value is model[3].err  # the same object, unchanged
    assert str(info.value) == OOM
    assert hooks_left(model) == []
    tr = prof.report().trace
    assert tr.error == f"RuntimeError: {OOM}"
    assert [p.phase.value for p in tr.phases] == ["forward"]
    live = tr.live_at_error
    assert_sums(live)
    assert live[C.WEIGHTS] == weight_bytes(model)  # (32*64+64 + 64*64+64) * 4 = (2112 + 4160) * 4 = 25088
    assert live[C.WEIGHTS] == 25088
    assert live[C.ACTIVATIONS] == expected_saved
    assert live[C.INPUTS] == 16 * 32 * 4
    # The failing module's scratch is live in the traceback and named first.
    assert live[C.TEMPORARIES] >= 4_000_000
    assert tr.live_modules_at_error[0] == ("3", 4_000_000)
    assert tr.peak.total == live.total  # the failing moment is the highest point
    assert "What was live at the OOM" in str(prof.report())  # an OOM: the report leads with it


class _BackwardBoom(torch.autograd.Function):
    err = RuntimeError(OOM)

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        scratch = torch.empty(500, 500)  # noqa: F841  500*500*4 = 1,000,000 B, alive in the traceback
        raise _BackwardBoom.err


class BackwardBoom(nn.Module):
    def forward(self, x):
        return _BackwardBoom.apply(x)


def _backward_fault_run():
    model = nn.Sequential(nn.Linear(32, 64), BackwardBoom(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 32)
    with pytest.raises(RuntimeError) as info:
        with memprof.profile(model, opt) as prof:
            model(x).sum().backward()
    return model, prof, info


def test_oom_mid_backward_propagates_and_cleans_up():
    model, prof, info = _backward_fault_run()
    assert info.value is _BackwardBoom.err
    assert hooks_left(model) == []
    tr = prof.report().trace
    assert tr.error == f"RuntimeError: {OOM}"
    assert [p.phase.value for p in tr.phases] == ["forward", "backward"]
    live = tr.live_at_error
    assert_sums(live)
    assert live[C.WEIGHTS] == weight_bytes(model)
    # Linear "2" ran its backward before the failure: its grads exist, (64*10 + 10) * 4 = 2600 B.
    assert live[C.GRADIENTS] == 2600
    assert live[C.TEMPORARIES] >= 1_000_000


def test_oom_mid_backward_names_the_failing_module():
    model, prof, info = _backward_fault_run()
    # The 1,000,000 B scratch was created inside module "1"'s backward.
    path, nbytes = prof.trace.live_modules_at_error[0]
    assert path == "1" and nbytes >= 1_000_000


def test_exception_in_loss_after_forward():
    model = MLP()
    err = ValueError("bad target")
    with pytest.raises(ValueError) as info:
        with memprof.profile(model) as prof:
            out = model(torch.randn(4, 32))
            raise err
    assert info.value is err
    assert hooks_left(model) == []
    assert prof.trace.live_at_error[C.ACTIVATIONS] == 2 * 4 * 64 * 4  # two ReLU results 4x64 fp32
    del out


def test_keyboard_interrupt_also_unwinds():
    model = MLP()
    with pytest.raises(KeyboardInterrupt):
        with memprof.profile(model) as prof:
            model(torch.randn(4, 32)).sum().backward()
            raise KeyboardInterrupt
    assert hooks_left(model) == []
    assert prof.trace.error == "KeyboardInterrupt: "


# ----------------------------------------------------------------- bit-identical


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.drop = nn.Dropout(0.3)
        self.norm = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(self.norm(self.drop(F.gelu(self.fc1(x)))))


def _train_dropnet(mode):
    torch.manual_seed(123)  # the model init and dropout both draw from the default generator
    model = DropNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    losses = []
    ctx = memprof.profile(model, opt, mode=mode) if mode else torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t)
    with ctx:
        for _ in range(4):
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], torch.rand(3)


@pytest.mark.parametrize("mode", ["exact", "light"])
def test_bit_identical_results_with_dropout(mode):
    l0, p0, r0 = _train_dropnet(None)
    l1, p1, r1 = _train_dropnet(mode)
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert torch.equal(r0, r1)  # memprof consumed no random numbers


# ---------------------------------------------------------------------- misuse


def _message_names_fix(exc):
    msg = str(exc)
    # The fix is named after a semicolon, or as where/how to use the call instead.
    return ";" in msg or " use " in msg or "pass " in msg or "give " in msg or "only valid inside" in msg


def test_misuse_gives_memprof_errors_naming_the_fix():
    model = MLP()
    cases = [
        (lambda: memprof.profile(lambda x: x), InvalidArgumentError),
        (lambda: memprof.profile(model, optimizer="adam"), InvalidArgumentError),
        (lambda: memprof.profile(model, [torch.optim.SGD(model.parameters(), lr=1), object()]),
         InvalidArgumentError),
        (lambda: memprof.profile(model, [torch.optim.SGD(model.fc1.parameters(), lr=1),
                                         torch.optim.SGD(MLP().parameters(), lr=1)]), InvalidArgumentError),
        (lambda: memprof.profile(model, mode=None), UnknownNameError),
        (lambda: memprof.profile(model).report(), ProfilerStateError),
        (lambda: memprof.profile(model).trace, ProfilerStateError),
        (lambda: memprof.profile(model).step().__enter__(), ProfilerStateError),
    ]
    for fn, cls in cases:
        with pytest.raises(cls) as info:
            fn()
        assert isinstance(info.value, MemprofError)
        assert _message_names_fix(info.value), str(info.value)


def test_report_of_a_non_trace_names_the_fix():
    with pytest.raises(InvalidArgumentError) as info:
        memprof.Report({"format": "memprof.trace"})
    assert _message_names_fix(info.value), str(info.value)


def test_report_lookups_refuse_unknown_names():
    model = MLP()
    with memprof.profile(model) as prof:
        model(torch.randn(4, 32)).sum().backward()
    rep = prof.report()
    for bad in ("weight", "grads", 3, None, ""):
        with pytest.raises(UnknownNameError, match="use one of"):
            rep.peak[bad]
    with pytest.raises(UnknownNameError, match="use one of: forward, backward, optimizer, other"):
        rep.breakdown(0, "fwd")
    with pytest.raises(InvalidArgumentError, match="peak, start, end"):
        rep.breakdown(0, "forward", "middle")
    with pytest.raises(InvalidArgumentError, match="must be an int"):
        rep.breakdown("0", "forward")
    with pytest.raises(NotMeasuredError, match="no forward phase"):
        rep.breakdown(0, "forward", occurrence=3)
    with pytest.raises(InvalidArgumentError, match="peak, start or end"):
        rep.breakdown_frame("max")
    with pytest.raises(UnknownNameError):
        memprof.Breakdown.from_mapping({"weight": 1})


def test_nesting_the_same_model_leaves_the_outer_profile_intact():
    model = MLP()
    x = torch.randn(4, 32)
    with memprof.profile(model) as outer:
        with pytest.raises(ProfilerStateError, match="exit that block first"):
            with memprof.profile(model):
                pass
        model(x).sum().backward()
    assert hooks_left(model) == []
    # The refused inner profile did not disturb the outer one: 2 ReLU results 4*64*4.
    assert outer.report().breakdown(0, "forward", "end")[C.ACTIVATIONS] == 2 * 4 * 64 * 4


def test_nesting_on_a_submodule_is_refused_or_exact():
    model = MLP()
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    expected = saved_activation_bytes(lambda: F.cross_entropy(model(x), y), list(model.parameters()) + [x, y])
    # 2 ReLU results 8*64*4 = 2 * 2048, log-softmax 8*10*4 = 320, total_weight 4
    assert expected == 4096 + 320 + 4
    try:
        with memprof.profile(model) as outer:
            with memprof.profile(model.fc1):
                F.cross_entropy(model(x), y).backward()
    except ProfilerStateError:
        return  # refused clearly: fine
    assert outer.report().breakdown(0, "forward", "end")[C.ACTIVATIONS] == expected


def test_meta_device_model_is_refused():
    with torch.device("meta"):
        model = MLP()
    with pytest.raises(InvalidArgumentError, match="meta device") as info:
        memprof.profile(model)
    assert _message_names_fix(info.value)


def test_meta_device_error_names_a_fix_that_exists():
    with torch.device("meta"):
        model = MLP()
    with pytest.raises(InvalidArgumentError) as info:
        memprof.profile(model)
    if "memprof.estimate" in str(info.value):
        assert callable(getattr(memprof, "estimate", None))

