"""A user's parallelize function that memprof cannot run is refused with an error naming it and the fix.

memprof calls ``fn(model, mesh)`` (or ``fn(model)``) on a fake process group of its own. A function whose
parameters take neither call, or one that initialises its own process group (torch says "twice"), is an
InvalidArgumentError naming the function and what memprof calls it with, not a TypeError or ValueError from
the middle of the simulation; any other error of the function's own is the user's and propagates unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import memprof
from memprof.errors import InvalidArgumentError

from tests.integration.test_parallelize import IDS, build, loss_fn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


def _estimate(fn):
    return memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                            world_size=2, parallelize=fn)


def initialises_its_own_group(model, mesh):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    return model


def test_a_function_that_initialises_its_own_process_group():
    with pytest.raises(InvalidArgumentError) as info:
        _estimate(initialises_its_own_group)
    text = str(info.value)
    assert "parallelize=initialises_its_own_group initialises a process group itself" in text
    assert "trying to initialize the default process group twice" in text  # torch's words, quoted
    assert "outside the function" in text
    assert isinstance(info.value.__cause__, ValueError)  # the user's error is kept, not swallowed
    assert not dist.is_initialized()  # memprof's fake group is gone with the estimate


def three(model, mesh, plan):
    return model


def nothing():
    return None


def keyword_mesh(model, *, mesh):
    return model


@pytest.mark.parametrize("fn, signature", [(three, "(model, mesh, plan)"), (nothing, "()"),
                                           (keyword_mesh, "(model, *, mesh)")])
def test_a_function_whose_parameters_take_neither_call(fn, signature):
    with pytest.raises(InvalidArgumentError) as info:
        _estimate(fn)
    text = str(info.value)
    assert text.startswith(f"parallelize={fn.__name__} takes {signature}, but memprof calls it as fn(model, mesh)")
    assert "or fn(model)" in text
    assert not dist.is_initialized()


def test_the_calls_that_bind_still_run():
    seen = []

    def model_only(model):
        seen.append("model")

    def with_default(model, mesh, plan=None):
        seen.append(type(mesh).__name__)
        return model

    for fn in (model_only, with_default):
        assert _estimate(fn).trace.distributed.world_size == 2
    assert seen == ["model", "DeviceMesh"]


def test_the_functions_own_errors_are_its_own():
    def fails(model, mesh):
        raise ValueError("my own mistake")

    with pytest.raises(ValueError, match="^my own mistake$"):
        _estimate(fails)
    assert not dist.is_initialized()
