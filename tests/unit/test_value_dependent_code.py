"""The watcher of value-dependent library code counts what that code builds, whoever called the same torch
function just before or after it: the answer for a call is worked out from the frames above it, never carried
over from another call."""

from __future__ import annotations

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
