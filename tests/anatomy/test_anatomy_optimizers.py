"""Optimizer formulas vs. real torch.optim optimizers run on CPU.

Expected values are measured here, independently of the formulas: persistent
state = sum of numel * element_size over the deduplicated storages in
``optimizer.state`` after one step; step transients = peak of live new storages
seen by a TorchDispatchMode during a second (steady-state) step.
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memprof.anatomy.optimizer_rules import bitsandbytes_formula
from memprof.anatomy.optimizers import (
    OptimizerFormula,
    optimizer_formula,
    optimizer_implementation,
    param_group_implementations,
    predict_optimizer_state_bytes,
    predict_optimizer_step_transient_bytes,
    register_optimizer_formula,
)
from memprof.errors import InvalidArgumentError, RegistryError

O = torch.optim
SHAPES = ((64, 64), (32, 32), (100,), (8, 16), (2, 3, 16))


class LiveStorages(TorchDispatchMode):
    """Tracks storages created inside the mode; storages that existed before are ignored."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._new: dict[int, weakref.ref] = {}
        self._old: dict[int, weakref.ref] = {}

    def _forget_old(self, key: int) -> None:
        self._old.pop(key, None)

    def _freed(self, key: int, nbytes: int) -> None:
        self._new.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self._new and key not in self._old:
                    # a storage from before the mode (or made outside dispatch): not a temporary
                    self._old[key] = weakref.ref(st, lambda _, k=key: self._forget_old(k))
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key in self._new or key in self._old:
                    continue
                n = st.nbytes()
                self._new[key] = weakref.ref(st, lambda _, k=key, n=n: self._freed(k, n))
                self.live += n
                self.peak = max(self.peak, self.live)
        return out


def make_params(dtype=torch.float32, shapes=SHAPES):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def set_grads(params):
    for p in params:
        p.grad = torch.randn_like(p)


def measured_state_bytes(opt) -> int:
    seen: dict[int, int] = {}
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                seen[v.untyped_storage()._cdata] = v.numel() * v.element_size()
    return sum(seen.values())


def measured_step_transient(opt, params) -> int:
    set_grads(params)
    opt.step()
    set_grads(params)
    mode = LiveStorages()
    with mode:
        opt.step()
    return mode.peak


CONFIGS = [
    ("sgd", O.SGD, dict(lr=0.1)),
    ("sgd_momentum", O.SGD, dict(lr=0.1, momentum=0.9)),
    ("sgd_momentum_foreach_wd", O.SGD, dict(lr=0.1, momentum=0.9, foreach=True, weight_decay=0.1)),
    ("adam", O.Adam, {}),
    ("adam_l2_foreach", O.Adam, dict(weight_decay=0.1, foreach=True)),
    ("adamw_loop", O.AdamW, {}),
    ("adamw_foreach", O.AdamW, dict(foreach=True)),
    ("adamw_fused", O.AdamW, dict(fused=True)),
    ("adamw_amsgrad_foreach", O.AdamW, dict(amsgrad=True, foreach=True)),
    ("adamw_maximize_foreach", O.AdamW, dict(maximize=True, foreach=True)),
    ("adagrad", O.Adagrad, {}),
    ("adagrad_foreach", O.Adagrad, dict(foreach=True)),
    ("adagrad_foreach_maximize", O.Adagrad, dict(foreach=True, maximize=True)),
    ("rmsprop", O.RMSprop, {}),
    ("rmsprop_foreach", O.RMSprop, dict(foreach=True)),
    ("rmsprop_centered", O.RMSprop, dict(centered=True, foreach=True)),
    ("rmsprop_momentum", O.RMSprop, dict(momentum=0.9, foreach=True)),
    ("rmsprop_momentum_centered_wd", O.RMSprop, dict(momentum=0.9, centered=True, weight_decay=0.1, foreach=True)),
    ("adafactor", O.Adafactor, {}),
    ("adafactor_foreach", O.Adafactor, dict(foreach=True)),
]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,cls,kwargs", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_state_bytes_exact(name, cls, kwargs, dtype):
    params = make_params(dtype)
    opt = cls(params, **kwargs)
    predicted = predict_optimizer_state_bytes(opt)
    set_grads(params)
    opt.step()
    assert predicted == measured_state_bytes(opt)


def test_state_bytes_literal_adamw_fp32_and_bf16():
    # 3 params of 1000 elements: fp32 AdamW = 2 states x 4 B x 3000 + 3 step scalars x 4 B = 24,012.
    params = [torch.nn.Parameter(torch.zeros(1000)) for _ in range(3)]
    assert predict_optimizer_state_bytes(O.AdamW(params)) == 24_012
    # bf16: states follow the parameter dtype (zeros_like): 2 x 2 B x 3000 + 3 x 4 (fp32 steps) = 12,012.
    params = [torch.nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16)) for _ in range(3)]
    assert predict_optimizer_state_bytes(O.AdamW(params)) == 12_012


def test_adafactor_state_is_factored():
    # A 64x32 matrix: row_var (64,1) + col_var (1,32) = 96 fp32 = 384 B, + 4 B step = 388; a 10-vector: 40 + 4.
    params = [torch.nn.Parameter(torch.zeros(64, 32)), torch.nn.Parameter(torch.zeros(10))]
    opt = O.Adafactor(params)
    assert predict_optimizer_state_bytes(opt) == 388 + 44
    set_grads(params)
    opt.step()
    assert opt.state[params[0]]["row_var"].shape == (64, 1)
    assert opt.state[params[0]]["col_var"].shape == (1, 32)
    assert measured_state_bytes(opt) == 432


def test_params_without_grad_get_no_state():
    params = make_params()
    frozen = params[0]
    opt = O.AdamW(params, foreach=True)
    with_grad = params[1:]
    for p in with_grad:
        p.grad = torch.randn_like(p)
    opt.step()
    assert frozen not in opt.state
    assert predict_optimizer_state_bytes(opt, params_with_grad=with_grad) == measured_state_bytes(opt)
    # the default assumes every requires_grad parameter gets a grad: 2 x 64*64*4 + 4 more bytes
    assert predict_optimizer_state_bytes(opt) == measured_state_bytes(opt) + 2 * 64 * 64 * 4 + 4


def test_requires_grad_false_gets_no_state():
    params = make_params()
    params[0].requires_grad_(False)
    opt = O.SGD(params, lr=0.1, momentum=0.9)
    set_grads(params[1:])
    opt.step()
    assert predict_optimizer_state_bytes(opt) == measured_state_bytes(opt)


def test_adagrad_state_exists_before_any_step():
    # Adagrad allocates sum and step in __init__, even for a parameter that never gets a grad.
    params = make_params()
    opt = O.Adagrad(params)
    assert predict_optimizer_state_bytes(opt, params_with_grad=[]) == measured_state_bytes(opt)
    assert measured_state_bytes(opt) > 0


FOREACH = [c for c in CONFIGS if c[2].get("foreach")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,cls,kwargs", FOREACH, ids=[c[0] for c in FOREACH])
def test_foreach_transient_exact(name, cls, kwargs, dtype):
    params = make_params(dtype)
    opt = cls(params, **kwargs)
    assert optimizer_implementation(opt) == "foreach"
    predicted = predict_optimizer_step_transient_bytes(opt)
    assert predicted == measured_step_transient(opt, params)


def test_foreach_adamw_is_one_copy_of_the_params():
    # AdamW foreach transient = one fp32 copy of all params (4.00 B/param): torch/optim/adam.py _foreach_sqrt;
    # measured with torch 2.13, see docs/anatomy.md#measured-optimizer-state-and-step-transients.
    params = make_params()
    n = sum(p.numel() for p in params)
    opt = O.AdamW(params, foreach=True)
    assert predict_optimizer_step_transient_bytes(opt) == 4 * n
    assert measured_step_transient(opt, params) == 4 * n


MULTI_DTYPE = [
    (torch.float32, ((64, 64), (10,))),
    (torch.bfloat16, ((32, 32), (8,))),
    (torch.float64, ((16, 16),)),
    (torch.float16, ((50, 50),)),
]


@pytest.mark.parametrize("ngroups", [2, 4])
@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (O.AdamW, dict(foreach=True)),
        (O.Adagrad, dict(foreach=True)),
        (O.Adagrad, dict(foreach=True, maximize=True)),
        (O.RMSprop, dict(foreach=True, weight_decay=0.1)),
        (O.SGD, dict(lr=0.1, foreach=True, weight_decay=0.1)),
        (O.Adafactor, dict(foreach=True)),
    ],
    ids=["adamw", "adagrad", "adagrad_max", "rmsprop_wd", "sgd_wd", "adafactor"],
)
def test_foreach_transient_exact_with_several_dtype_groups(cls, kwargs, ngroups):
    params = []
    for dtype, shapes in MULTI_DTYPE[:ngroups]:
        params += make_params(dtype, shapes)
    opt = cls(params, **kwargs)
    assert predict_optimizer_step_transient_bytes(opt) == measured_step_transient(opt, params)


def test_foreach_adamw_two_dtype_groups_hold_both_copies():
    # fp32 group 64*64*4 + 10*4 = 16,424 B; bf16 group 32*32*2 + 8*2 = 2,064 B. The first group's sqrt list is
    # still referenced when the second is built: peak = 16,424 + 2,064 = 18,488.
    params = make_params(torch.float32, ((64, 64), (10,))) + make_params(torch.bfloat16, ((32, 32), (8,)))
    opt = O.AdamW(params, foreach=True)
    assert predict_optimizer_step_transient_bytes(opt) == 18_488
    assert measured_step_transient(opt, params) == 18_488


LOOP = [c for c in CONFIGS if not c[2].get("foreach") and not c[2].get("fused")] + [
    ("adamw_maximize", O.AdamW, dict(maximize=True)),
    ("adam_l2", O.Adam, dict(weight_decay=0.1)),
    ("adagrad_wd", O.Adagrad, dict(weight_decay=0.1)),
    ("rmsprop_all", O.RMSprop, dict(momentum=0.9, centered=True, weight_decay=0.1, maximize=True)),
    ("sgd_all", O.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1, maximize=True)),
    ("adafactor_maximize", O.Adafactor, dict(maximize=True)),
]


@pytest.mark.parametrize("shapes", [SHAPES, ((4096,),) * 4, ((64, 64),) * 4], ids=["mixed", "vectors", "matrices"])
@pytest.mark.parametrize("name,cls,kwargs", LOOP, ids=[c[0] for c in LOOP])
def test_for_loop_transient_is_an_upper_bound(name, cls, kwargs, shapes):
    params = make_params(torch.float32, shapes)
    opt = cls(params, **kwargs)
    assert optimizer_implementation(opt) == "for-loop"
    predicted = predict_optimizer_step_transient_bytes(opt)
    measured = measured_step_transient(opt, params)
    assert measured <= predicted
    if name in ("sgd", "sgd_momentum"):
        assert predicted == 0 and measured == 0
    else:
        # the bound is not vacuous: at least one parameter-sized temporary really exists
        assert measured >= max(p.numel() * p.element_size() for p in params)


def test_for_loop_adamw_bound_is_reached_with_equal_tensors():
    # 8 equal tensors, steady-step transient = 3 x the largest (sqrt + div + previous denom); measured with
    # torch 2.13, see docs/anatomy.md#measured-optimizer-state-and-step-transients.
    params = make_params(torch.float32, ((4096,),) * 8)
    opt = O.AdamW(params)
    assert predict_optimizer_step_transient_bytes(opt) == 3 * 4096 * 4
    assert measured_step_transient(opt, params) == 3 * 4096 * 4


@pytest.mark.parametrize("cls", [O.AdamW, O.Adam, O.SGD, O.Adagrad])
def test_fused_transient_is_zero(cls):
    params = make_params()
    kwargs = dict(lr=0.1, momentum=0.9) if cls is O.SGD else {}
    opt = cls(params, fused=True, **kwargs)
    assert optimizer_implementation(opt) == "fused"
    assert predict_optimizer_step_transient_bytes(opt) == 0
    assert measured_step_transient(opt, params) == 0


def test_implementation_defaults_follow_torch():
    params = make_params()
    # CPU parameters: foreach=None, fused=None -> for-loop (foreach only on CUDA/XPU/MTIA/privateuse1)
    assert optimizer_implementation(O.AdamW(params)) == "for-loop"
    assert optimizer_implementation(O.RMSprop(params)) == "for-loop"
    # Adafactor: foreach=None means the for-loop on every device
    assert optimizer_implementation(O.Adafactor(params)) == "for-loop"
    meta = [torch.nn.Parameter(torch.empty(4, 4, device="meta"))]
    assert optimizer_implementation(O.AdamW(meta)) == "for-loop"


def test_implementation_per_group():
    a, b = make_params(shapes=((4, 4),)), make_params(shapes=((3,),))
    opt = O.AdamW([{"params": a, "foreach": True}, {"params": b}])
    assert param_group_implementations(opt) == ["foreach", "for-loop"]
    with pytest.raises(InvalidArgumentError):
        optimizer_implementation(opt)


def test_unknown_optimizer_has_no_formula():
    params = make_params()
    opt = O.NAdam(params)
    assert optimizer_formula(opt) is None
    assert predict_optimizer_state_bytes(opt) is None
    assert predict_optimizer_step_transient_bytes(opt) is None


def test_subclass_uses_base_formula_and_duplicates_raise():
    class MyAdamW(O.AdamW):
        pass

    params = make_params()
    assert optimizer_formula(MyAdamW(params)) is optimizer_formula(O.AdamW(params))
    with pytest.raises(RegistryError):
        register_optimizer_formula(O.AdamW, optimizer_formula(O.AdamW(params)))
    formula = OptimizerFormula("mine", "test", lambda opt, group, ps: 7 * len(ps))
    register_optimizer_formula(MyAdamW, formula)
    assert predict_optimizer_state_bytes(MyAdamW(params)) == 7 * len(params)
    with pytest.raises(RegistryError):
        register_optimizer_formula(MyAdamW, formula)


# ----------------------------------------------------------------------------- bitsandbytes (faked)


def _fake_bnb(qualname: str, module: str):
    class Fake:
        def __init__(self, params, min_8bit_size=4096):
            self.param_groups = [{"params": list(params)}]
            self.state: dict = {}
            self.args = type("Args", (), {"min_8bit_size": min_8bit_size})()

    Fake.__qualname__ = qualname
    Fake.__name__ = qualname
    Fake.__module__ = module
    return Fake


def test_bitsandbytes_adamw8bit_by_name():
    AdamW8bit = _fake_bnb("AdamW8bit", "bitsandbytes.optim.adamw")
    big = torch.nn.Parameter(torch.zeros(10_000))
    small = torch.nn.Parameter(torch.zeros(100))
    opt = AdamW8bit([big, small])
    assert optimizer_formula(opt) is not None
    # big: 2 uint8 states = 20,000 B + 2 absmax of ceil(10,000/256) = 40 fp32 each = 320 B;
    # small (< 4096 elements): 2 fp32 states = 800 B; shared qmaps: 2 x 256 x 4 = 2,048 B.
    assert predict_optimizer_state_bytes(opt) == 20_000 + 320 + 800 + 2_048
    assert predict_optimizer_step_transient_bytes(opt) is None


def test_bitsandbytes_old_blocksize_and_min_size():
    formula = bitsandbytes_formula("AdamW8bit-old", 2, blocksize=2048)
    Old = _fake_bnb("OldAdamW8bit", "tests_only.bnb_old")
    register_optimizer_formula(Old, formula)
    p = torch.nn.Parameter(torch.zeros(10_000))
    # 2 x 10,000 + 2 x ceil(10,000/2048) = 5 fp32 = 40 B; + 2,048 qmaps = 22,088 (2.0044 B/param before qmaps)
    assert predict_optimizer_state_bytes(Old([p])) == 20_000 + 40 + 2_048
    # min_8bit_size above the numel: fp32 states, no qmaps: 2 x 4 x 10,000
    assert predict_optimizer_state_bytes(Old([p], min_8bit_size=20_000)) == 80_000


def test_bitsandbytes_lion_is_one_state():
    Lion8bit = _fake_bnb("Lion8bit", "bitsandbytes.optim.lion")
    p = torch.nn.Parameter(torch.zeros(4096))
    # 4,096 uint8 + ceil(4096/256) = 16 fp32 absmax = 64 B + one 1,024 B qmap
    assert predict_optimizer_state_bytes(Lion8bit([p])) == 4096 + 64 + 1024
    assert math.isclose(4096 / 4096 + 64 / 4096, 1.015625)
