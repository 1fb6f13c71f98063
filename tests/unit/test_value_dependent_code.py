"""The watcher of value-dependent library code counts what that code builds, whoever called the same torch
function just before or after it: the answer for a call is worked out from the frames above it, never carried
over from another call."""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

from memprof.simulate.kernels import ValueDependentCode
from memprof.simulate.modes import Rules

# A module whose name puts it among transformers' mask helpers (VALUE_DEPENDENT_CODE matches by prefix).
_MASKS = types.ModuleType("transformers.masking_utils_probe")
exec("def mask_helper(lin, x):\n    return lin(x)\n", _MASKS.__dict__)


def _user_helper(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return lin(x)


def test_each_call_is_judged_by_its_own_callers():
    lin = nn.Linear(1000, 1000, device="meta")
    x = torch.empty(1000, 1000, device="meta")
    for order in (["mask", "user", "user"], ["user", "mask", "mask"], ["mask", "mask", "user", "mask"]):
        vdc = ValueDependentCode()
        with Rules(vdc):
            for who in order:
                before = vdc.bytes
                (_MASKS.mask_helper if who == "mask" else _user_helper)(lin, x)
                # nn.Linear's output: 1,000 x 1,000 fp32 = 4,000,000 B, counted only when the mask helper made it.
                assert vdc.bytes - before == (4_000_000 if who == "mask" else 0), (order, who)
        assert vdc.calls == order.count("mask")
        assert vdc.where == {"transformers.masking_utils_probe"}


# A module named as one of memprof's step runners (kernels._DRIVERS matches by prefix), and one named as torch's.
_DRIVER = types.ModuleType("memprof.simulate.step_probe")
exec("def run(fn, *args):\n    return fn(*args)\n", _DRIVER.__dict__)
_TORCH = types.ModuleType("torch.optim_probe")
exec("def step(lin, x):\n    return lin(x)\n", _TORCH.__dict__)


def test_a_walk_ends_at_the_frame_that_runs_the_step_and_sees_all_below_it():
    lin = nn.Linear(1000, 1000, device="meta")
    x = torch.empty(1000, 1000, device="meta")
    vdc = ValueDependentCode()
    with Rules(vdc):
        # The mask helper runs below the step runner: found before the walk reaches it (4,000,000 B, as above).
        _DRIVER.run(_MASKS.mask_helper, lin, x)
        assert (vdc.bytes, vdc.calls) == (4_000_000, 1)
        # Torch's code called by the step runner (an optimizer's op): nothing of the library's, and the walk stops
        # at the runner instead of climbing through the estimate and its caller.
        _DRIVER.run(_TORCH.step, lin, x)
        assert (vdc.bytes, vdc.calls) == (4_000_000, 1)
    frames = []
    _DRIVER.run(lambda: frames.append(sys._getframe(1)))  # the runner's own frame, called from this test
    # Before, the walk went on past the runner to this test's frame (a user frame: anyone else's code).
    assert vdc._user_frame(frames[0]) is None
