"""Misuse: every misuse refused with a MemprofError that names the fix, nesting profiles, a meta-device
model, report lookups of names that do not exist."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memprof
from memprof import Category as C
from memprof.errors import InvalidArgumentError, MemprofError, NotMeasuredError, ProfilerStateError, UnknownNameError

from helpers import hooks_left, saved_activation_bytes
from models import MLP


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
