"""A simulation leaves no fake tensor in the model code's ``functools`` caches (memprof/simulate/kept_caches.py):
the user's training after an estimate is the training without one, bit for bit."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import memprof
from memprof.simulate import kept_caches

import cached_helpers
import cached_helpers as helpers_alias
from cached_helpers import Rope, deeper, random_features


@functools.lru_cache(maxsize=8)
def _positions(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)


class _Positional(nn.Module):
    """Adds a position ramp kept in a process-wide cache, as models cache their position tables."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x + _positions(x.shape[-1]))


def _train(model: nn.Module, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters())
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item(), [p.detach().clone() for p in model.parameters()]


def _same_training(model: nn.Module, x: torch.Tensor) -> None:
    """Training ``model`` after an estimate of it equals training a copy made before."""
    untouched = copy.deepcopy(model)
    memprof.estimate(model, torch.optim.AdamW, inputs=x, loss_fn=lambda out: out.pow(2).mean(), steps=1)
    loss, params = _train(model, x)
    loss0, params0 = _train(untouched, x)
    assert loss == loss0
    assert all(torch.equal(a, b) for a, b in zip(params, params0))


def test_a_cache_a_simulation_filled_is_emptied_and_training_after_it_is_unchanged():
    _positions.cache_clear()
    torch.manual_seed(0)
    model, x = _Positional(), torch.randn(4, 8)
    memprof.estimate(model, torch.optim.AdamW, inputs=x, loss_fn=lambda out: out.pow(2).mean(), steps=1)
    assert _positions.cache_info().currsize == 0  # the fake ramp the simulation cached is gone
    assert type(_positions(8)) is torch.Tensor
    _same_training(model, x)


def test_a_cache_the_simulation_only_read_is_left_as_it_was():
    _positions.cache_clear()
    kept = _positions(8)  # filled by the user's real code first
    torch.manual_seed(0)
    memprof.estimate(_Positional(), torch.optim.AdamW, inputs=torch.randn(4, 8),
                     loss_fn=lambda out: out.pow(2).mean(), steps=1)
    assert _positions.cache_info().currsize == 1 and _positions(8) is kept  # a hit adds nothing: not emptied


def test_beits_relative_position_index_cache_holds_no_fake_tensor_after_an_estimate():
    # transformers' compile_compatible_method_lru_cache keys BEiT's relative position index by the module: the
    # estimate's fake index was read by the next real forward (a FakeTensor loss, half the parameters not stepped).
    T = pytest.importorskip("transformers")
    cfg = T.BeitConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       image_size=32, patch_size=8, use_relative_position_bias=True, num_labels=5)
    torch.manual_seed(0)
    model = T.BeitForImageClassification(cfg)

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.beit = model

        def forward(self, pixels: torch.Tensor) -> torch.Tensor:
            return self.beit(pixel_values=pixels).logits

    _same_training(Logits(), torch.randn(2, 3, 32, 32))


def test_the_caches_are_found_in_the_models_classes_and_modules_and_the_step_functions_modules():
    # The static method's cache kept in transformers' decorator closure (BEiT's), a module-level cached function of
    # the model's module (_positions), and nothing of torch's; found without walking the heap.
    T = pytest.importorskip("transformers")
    from transformers.models.beit.modeling_beit import BeitRelativePositionBias

    cfg = T.BeitConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=32,
                       patch_size=8, use_relative_position_bias=True, num_labels=5)
    found = [c for c, _ in kept_caches._caches(T.BeitForImageClassification(cfg), ()).values()]
    index = list(kept_caches._cached(vars(BeitRelativePositionBias)["generate_relative_position_index"]))
    assert len(index) == 1 and index[0] in found
    assert _positions in [c for c, _ in kept_caches._caches(_Positional(), ()).values()]
    assert _positions in [c for c, _ in kept_caches._caches(nn.Linear(2, 2), (_train,)).values()]  # via _train's module
    assert not any(c.__module__.startswith("torch") for c in found)


class _Reaching(nn.Module):
    """Adds what ``extra(n)`` returns, a cached helper's table reached in the way ``how`` names."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.proj = how, nn.Linear(8, 8)
        if how == "instance":
            self.table = functools.lru_cache(maxsize=None)(lambda n: torch.arange(n, dtype=torch.float32) * 2)
        if how == "partial":
            self.table = functools.partial(cached_helpers.table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, how = x.shape[-1], self.how
        extra = (helpers_alias.table(n) if how == "module_alias" else deeper(n) if how == "behind_a_helper"
                 else Rope.freqs(n) if how == "helper_class" else self.table(n))
        return self.proj(x + extra)


@pytest.mark.parametrize("how", ["module_alias", "behind_a_helper", "helper_class", "instance", "partial"])
def test_caches_reached_through_aliases_helpers_classes_and_attributes_hold_no_fake_tensor_after(how):
    for cache in (cached_helpers.table, cached_helpers._deep, Rope.freqs):
        cache.cache_clear()
    torch.manual_seed(0)
    _same_training(_Reaching(how), torch.randn(4, 8))


class _RandomFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x + random_features(x.shape[0], 8))


def test_the_users_own_entries_of_a_cache_the_simulation_added_to_are_kept():
    # Features drawn once per shape: emptied, the cache would draw the user's again and change their training. Only
    # the simulation's (fake) entry leaves an unbounded cache.
    random_features.cache_clear()
    torch.manual_seed(0)
    model = _RandomFeatures()
    kept = random_features(4, 8)  # the user's real entry, for their batch of 4, drawn first
    memprof.estimate(model, torch.optim.AdamW, inputs=torch.randn(64, 8), loss_fn=lambda out: out.pow(2).mean(),
                     steps=1)  # "would a batch of 64 fit?": a fake entry for (64, 8), taken out after
    assert random_features(4, 8) is kept and random_features.cache_info().currsize == 1


def test_a_module_holding_a_function_without_a_module_name_is_searched(monkeypatch):
    # Code exec'd with globals that have no __name__ makes functions whose __module__ is None; a model's module that
    # imports one beside another module's function made the search of its namespace sort None with a name
    # (TypeError from inside the estimate; found in the suite when a test's exec'd helper was in sys.modules).
    import sys
    import types

    home = types.ModuleType("memprof_test_nameless_home")
    exec("import torch\nfrom copy import deepcopy\nclass Net(torch.nn.Linear):\n    pass\n", home.__dict__)
    nameless: dict[str, object] = {}
    exec("def helper(x):\n    return x\n", nameless)
    home.helper = nameless["helper"]
    assert home.helper.__module__ is None and home.deepcopy.__module__ == "copy"
    monkeypatch.setitem(sys.modules, home.__name__, home)
    home.Net.__module__ = home.__name__
    kept_caches._MODULES.pop(home.__name__, None)
    est = memprof.estimate(home.Net(4, 2), torch.optim.SGD, inputs=torch.zeros(3, 4))
    # 4 x 2 weights + 2 biases, fp32: 40 B of weights at the peak
    assert est.trace.peak[memprof.Category.WEIGHTS] == 40
