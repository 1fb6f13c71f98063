"""The meta kernels' answers kept (memprof.simulate.meta_kernels): a call asked again gets new tensors of exactly
the metadata its kernel gave (sizes, strides, dtype, offset, storage bytes, a tuple where it gave one), without
the kernel; a view, an in-place op, a factory, an argument the key cannot describe and an answer new tensors do not
reproduce go to the kernel every time."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memprof.simulate import meta_kernels
from memprof.simulate.meta_kernels import MetaKernelCache


class _Kernels(TorchDispatchMode):
    """Beneath the cache: counts the calls that reach the kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def _fresh_answers(monkeypatch):
    monkeypatch.setattr(meta_kernels, "_ANSWERS", {})


def _meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), t.untyped_storage().nbytes())


def _twice(fn):
    """fn() run twice under the cache, with the kernels beneath counted: (first, second, kernel calls)."""
    kernels = _Kernels()
    with kernels, MetaKernelCache():
        first, second = fn(), fn()
    return first, second, kernels.calls


def _as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


CASES = {
    "broadcast mul": lambda a, b, i: a * b,
    "int tensor times an int": lambda a, b, i: i * 3,
    "int tensor times a float": lambda a, b, i: i * 3.0,
    "pow": lambda a, b, i: a.pow(2),
    "sum over a dim": lambda a, b, i: a.sum(dim=1, keepdim=True),
    "cat of a list": lambda a, b, i: torch.cat([a, a], dim=0),
    "transposed input": lambda a, b, i: a.t() + 1,
    "mm": lambda a, b, i: a @ a.t(),
    "log_softmax": lambda a, b, i: torch.log_softmax(a, dim=-1),
    "nll_loss (a kernel giving a tuple)": lambda a, b, i: torch.nn.functional.nll_loss(a, i[:, 0].clamp(0, 2)),
    "to bf16": lambda a, b, i: a.to(torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_answer_asked_again_is_the_kernels_metadata_without_the_kernel(name):
    a = torch.empty(4, 3, device="meta")
    b = torch.empty(3, device="meta")
    i = torch.empty(4, 3, dtype=torch.int64, device="meta")
    fn = lambda: CASES[name](a, b, i)  # noqa: E731
    expected = [_meta(t) for t in _as_list(fn())]  # the kernels alone, no cache
    first, second, calls = _twice(fn)
    assert [_meta(t) for t in _as_list(first)] == expected
    assert [_meta(t) for t in _as_list(second)] == expected
    # Each output of the second call is a new tensor of its own storage, as the kernel makes it.
    firsts, seconds = _as_list(first), _as_list(second)
    assert all(x.untyped_storage()._cdata != y.untyped_storage()._cdata for x, y in zip(firsts, seconds))
    assert {s.untyped_storage()._cdata for s in seconds} & {a.untyped_storage()._cdata,
                                                           i.untyped_storage()._cdata} == set()
    # The kernel of the answered op ran once, for the first call only; the other ops (views) each time.
    answered = [op for op, n in calls.items() if n == 1]
    assert answered, calls


def test_the_key_holds_a_scalars_type():
    i = torch.empty(5, dtype=torch.int64, device="meta")
    with MetaKernelCache():
        as_int, as_float = i * 2, i * 2.0
    assert (as_int.dtype, as_float.dtype) == (torch.int64, torch.float32)


def test_an_in_place_op_returns_its_self():
    a = torch.empty(4, 3, device="meta")
    b = torch.empty(4, 3, device="meta")
    kernels = _Kernels()
    with kernels, MetaKernelCache():
        outs = [a.addcdiv_(b, b, value=0.5) for _ in range(3)]
    assert all(o is a for o in outs)
    assert kernels.calls["aten.addcdiv_.default"] == 1


def test_views_factories_and_undescribed_arguments_reach_the_kernel_every_time():
    a = torch.empty(4, 3, device="meta")
    before = torch.get_default_dtype()
    kernels = _Kernels()
    try:
        with kernels, MetaKernelCache():
            views = [a.view(12) for _ in range(2)]
            made = [torch.zeros(3, device="meta")]
            torch.set_default_dtype(torch.float64)  # a factory's dtype is the default's: no key may hold it
            made.append(torch.zeros(3, device="meta"))
            cpu = torch.ones(2)
            on_cpu = [cpu + 1 for _ in range(2)]  # not a meta tensor: the key does not describe it
    finally:
        torch.set_default_dtype(before)
    assert all(v.untyped_storage()._cdata == a.untyped_storage()._cdata for v in views)  # still views of a
    assert kernels.calls["aten.view.default"] == 2
    assert [m.dtype for m in made] == [torch.float32, torch.float64]
    assert kernels.calls["aten.add.Tensor"] == 2 and all(t.device.type == "cpu" for t in on_cpu)


def test_an_answer_new_tensors_cannot_reproduce_runs_its_kernel_every_time():
    # A kernel whose output sits at an offset of a larger storage: new tensors would have other bytes.
    lib = torch.library.Library("memprof_meta_kernels_test", "DEF")
    lib.define("offset(Tensor x) -> Tensor")
    lib.impl("offset", lambda x: x.new_empty(x.numel() + 2)[2:], "Meta")
    op = torch.ops.memprof_meta_kernels_test.offset.default
    x = torch.empty(6, device="meta")
    first, second, calls = _twice(lambda: op(x))
    # 4 B x (6 + 2) = 32 B of storage, the output at offset 2, both times.
    assert _meta(first) == _meta(second) == ((6,), (1,), torch.float32, 2, 32)
    assert calls[str(op)] == 2


@pytest.mark.parametrize("op", [
    lambda i: i / i,  # true division of integers: the default dtype
    lambda i: i * 0.5,  # an integer tensor and a float: the default dtype
    lambda i: torch.sigmoid(i),  # a float function of an integer tensor: the default dtype
])
def test_the_key_holds_the_default_dtype_that_promotes_integers(op):
    # A kernel with a tensor argument may still read the process's default dtype (an integer tensor promoted to a
    # float): an answer kept under float32 must not be given once the default is float64.
    i = torch.empty(4, dtype=torch.int64, device="meta")
    before = torch.get_default_dtype()
    try:
        with MetaKernelCache():
            as_f32 = op(i)
            torch.set_default_dtype(torch.float64)
            as_f64 = op(i)
    finally:
        torch.set_default_dtype(before)
    # 4 elements x 4 B under float32, x 8 B under float64.
    assert (as_f32.dtype, as_f32.untyped_storage().nbytes()) == (torch.float32, 16)
    assert (as_f64.dtype, as_f64.untyped_storage().nbytes()) == (torch.float64, 32)
