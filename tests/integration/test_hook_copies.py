"""A copy or a pickle of a profiled model (an EMA copy, ``AveragedModel``, ``torch.save(model)`` inside the
block) neither carries memprof's hooks out of the profile nor fails: each hook memprof puts on a module or an
optimizer copies and pickles as a hook that does nothing and takes itself off at its first call."""

from __future__ import annotations

import copy
import io

import torch
from torch import nn

import memprof
from memprof.collect.hook_objects import DROPPED


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _hooks(module: nn.Module) -> list:
    return [h for m in module.modules() for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values()]


def _step(model, opt, x):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


def test_a_deep_copy_made_inside_a_profile_keeps_no_hook_of_memprofs():
    x = torch.randn(3, 4)
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt):
        _step(model, opt, x)
        ema = copy.deepcopy(model)  # what torch.optim.swa_utils.AveragedModel does
        opt_copy = copy.deepcopy(opt)
        # Inside the block the copy holds only inert hooks (a deep copy of memprof's tracker would be here).
        assert _hooks(ema) and all(h is DROPPED for h in _hooks(ema))
        ema(x)  # each takes itself off at its first call
        assert _hooks(ema) == []
    assert _hooks(model) == [] and _hooks(ema) == []
    assert all(h is DROPPED for h in opt_copy._optimizer_load_state_dict_post_hooks.values())
    # The copy computes what a copy made without memprof computes.
    plain_model = _model()
    plain_opt = torch.optim.AdamW(plain_model.parameters())
    _step(plain_model, plain_opt, x)
    assert torch.equal(copy.deepcopy(plain_model)(x), ema(x))


def test_a_copy_made_inside_and_called_only_after_the_profile_drops_its_hooks_there():
    x = torch.randn(3, 4)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.profile(model, opt):
        _step(model, opt, x)
        ema = copy.deepcopy(model)
    ema(x)
    assert _hooks(ema) == []
    # A profile of the copy afterwards measures it as any model (no hook of the first profile in the way).
    with memprof.profile(ema) as prof:
        ema(x)
    assert prof.report().peak.total > 0 and _hooks(ema) == []


def test_saving_the_whole_model_and_optimizer_inside_a_profile_works_and_loads_without_memprofs_hooks():
    x = torch.randn(3, 4)
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    buf = io.BytesIO()
    with memprof.profile(model, opt):
        _step(model, opt, x)
        torch.save({"model": model, "optimizer": opt}, buf)  # raised "Can't pickle local object" before
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert all(h is DROPPED for h in _hooks(loaded["model"]))
    assert torch.equal(loaded["model"](x), model(x))
    assert _hooks(loaded["model"]) == []
