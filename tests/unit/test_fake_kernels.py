"""The meta kernels' answers kept for fake tensors (memprof.simulate.meta_kernels given a fake mode): a call asked
again on the mode's fake tensors gets new fake tensors of exactly the device and metadata the fake mode gave, on
storages of the same bytes, and a view a new fake tensor on the storage of the argument it views, without the
kernel; a fake tensor holding a constant, another mode's, a real tensor and another namespace's op reach the fake
mode every time."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memprof.simulate import meta_kernels
from memprof.simulate.meta_kernels import MetaKernelCache

from test_meta_kernels import _Kernels  # between the cache and the fake mode: what reaches it


@pytest.fixture(autouse=True)
def _fresh_answers(monkeypatch):
    monkeypatch.setattr(meta_kernels, "_FAKE_ANSWERS", {})


def _meta(t: torch.Tensor) -> tuple:
    return (type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.storage_offset(), t.untyped_storage().nbytes())


def _as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _tensors(mode):
    with mode:
        return (torch.empty(4, 3), torch.empty(3), torch.empty(4, 3, dtype=torch.int64),
                torch.empty(2, 4, 3).transpose(0, 1))


# name -> (the call, the op it answers: asked twice, that op reaches the fake mode once).
FRESH = {
    "broadcast mul": (lambda a, b, i, s: a * b, "aten.mul.Tensor"),
    "int tensor times a float": (lambda a, b, i, s: i * 3.0, "aten.mul.Tensor"),
    "sum over a dim": (lambda a, b, i, s: a.sum(dim=1, keepdim=True), "aten.sum.dim_IntList"),
    "cat of a list": (lambda a, b, i, s: torch.cat([a, a], dim=0), "aten.cat.default"),
    "mm": (lambda a, b, i, s: a @ a.t(), "aten.mm.default"),
    "contiguous of a strided tensor": (lambda a, b, i, s: s.contiguous(), "aten.clone.default"),
    "log_softmax": (lambda a, b, i, s: torch.log_softmax(a, dim=-1), "aten._log_softmax.default"),
    "to bf16": (lambda a, b, i, s: a.to(torch.bfloat16), "aten._to_copy.default"),
    "var_mean (a tuple)": (lambda a, b, i, s: torch.var_mean(a, dim=0), "aten.var_mean.correction"),
}
VIEWS = {
    "view": (lambda a, b, i, s: a.view(12), "aten.view.default"),
    "t": (lambda a, b, i, s: a.t(), "aten.t.default"),
    "detach": (lambda a, b, i, s: a.detach(), "aten.detach.default"),
    "slice at an offset": (lambda a, b, i, s: a[1:3], "aten.slice.Tensor"),
    "select of a strided tensor": (lambda a, b, i, s: s[1], "aten.select.int"),
    "expand": (lambda a, b, i, s: b.expand(4, 3), "aten.expand.default"),
    "unsqueeze": (lambda a, b, i, s: a.unsqueeze(0), "aten.unsqueeze.default"),
    "as_strided": (lambda a, b, i, s: a.as_strided((2, 2), (3, 1), 4), "aten.as_strided.default"),
    "view as another dtype": (lambda a, b, i, s: a.view(torch.int32), "aten.view.dtype"),
    # No alias in its schema, but on its argument's storage (a matmul's reshape): kept as a view.
    "_unsafe_view": (lambda a, b, i, s: torch.ops.aten._unsafe_view(a, [12]), "aten._unsafe_view.default"),
}


@pytest.mark.parametrize("name", sorted(FRESH) + sorted(VIEWS))
def test_an_answer_asked_again_is_the_fake_modes_without_the_kernel(name):
    fn, answered = {**FRESH, **VIEWS}[name]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = _tensors(mode)
    with mode:
        expected = _as_list(fn(*args))  # the fake mode alone
    kernels = _Kernels()
    with mode, kernels, MetaKernelCache(mode):
        first, second = _as_list(fn(*args)), _as_list(fn(*args))
    assert [_meta(t) for t in first] == [_meta(t) for t in second] == [_meta(t) for t in expected]
    assert all(t.fake_mode is mode for t in second)
    bases = {t.untyped_storage()._cdata for t in args}
    if name in VIEWS:  # each a view of the tensor it viewed, as the fake mode's is
        for got, want in zip(second, expected):
            assert got.untyped_storage()._cdata == want.untyped_storage()._cdata
            assert got.untyped_storage()._cdata in bases
    else:  # each output a new storage of its own
        assert all(x.untyped_storage()._cdata != y.untyped_storage()._cdata for x, y in zip(first, second))
        assert {t.untyped_storage()._cdata for t in second} & bases == set()
    assert kernels.calls[answered] == 1, kernels.calls  # the first call's; the second was answered


def test_a_view_answered_writes_into_its_base():
    # The fake tensors carry no values, but the version counter an in-place op bumps is the base's as well.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    a, *_ = _tensors(mode)
    with mode, MetaKernelCache(mode):
        a.view(12)
        v = a.view(12)
        before = a._version
        v.add_(1)
    assert a._version == before + 1


def test_constants_other_modes_real_tensors_and_other_namespaces_reach_the_fake_mode_every_time():
    mode, other = FakeTensorMode(allow_non_fake_inputs=True), FakeTensorMode(allow_non_fake_inputs=True)
    lib = torch.library.Library("memprof_fake_kernels_test", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: torch.empty_like(x), "Meta")
    lib.impl("twice", lambda x: x * 2, "CPU")
    op = torch.ops.memprof_fake_kernels_test.twice.default
    with mode:
        constant = torch.tensor(2.0)  # the fake mode keeps its value
        a = torch.empty(3)
    with other:
        foreign = torch.empty(3)
    real = torch.ones(3)
    kernels = _Kernels()
    with mode, kernels, MetaKernelCache(mode):
        for _ in range(2):
            doubled = constant * 3
            foreign + 1
            a + real
            op(a)
    assert doubled.constant is not None and doubled.constant.item() == 6.0  # computed on the value
    assert kernels.calls["aten.mul.Tensor"] == 2
    assert kernels.calls["aten.add.Tensor"] == 4
    assert kernels.calls[str(op)] == 2


def _flags(t: torch.Tensor) -> tuple:
    return (_meta(t), t.is_inference(), t.is_neg(), t.layout)


@pytest.mark.parametrize("case", ["view in inference mode", "view of an inference tensor", "negated view",
                                  "a view of a negated view", "sparse argument", "sparse output"])
def test_inference_tensors_negation_bits_and_sparse_layouts_are_as_the_fake_mode_gives(case):
    # A view's inference flag follows its base, a new tensor's the mode; a view keeps its base's negation bit; a
    # sparse tensor has no strides or storage to describe (found by this change's review: each raised or differed).
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        a = torch.empty(4, 3)
    with torch.inference_mode(), mode:
        inferred = torch.empty(4, 3)
    calls = {
        "view in inference mode": (lambda: a.t(), torch.inference_mode),
        "view of an inference tensor": (lambda: inferred.t(), contextlib.nullcontext),
        "negated view": (lambda: torch._neg_view(a), contextlib.nullcontext),
        "a view of a negated view": (lambda: torch._neg_view(a).t(), contextlib.nullcontext),
        "sparse argument": (lambda: a.to_sparse() * 2, contextlib.nullcontext),
        "sparse output": (lambda: a.to_sparse(), contextlib.nullcontext),
    }
    fn, around = calls[case]
    with around(), mode:
        expected = _flags(fn()) if "sparse" not in case else (fn().layout, tuple(fn().shape))
    with around(), mode, MetaKernelCache(mode):
        got = [fn() for _ in range(3)]
    for out in got:
        assert (_flags(out) if "sparse" not in case else (out.layout, tuple(out.shape))) == expected


def test_a_fake_mode_with_a_shape_environment_keeps_no_answers():
    # Its answers depend on symbols and guards, not on the arguments' metadata alone.
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from memprof.errors import InvalidArgumentError
    from memprof.simulate.meta_kernels import answerable

    symbolic = FakeTensorMode(shape_env=ShapeEnv())
    assert not answerable(symbolic) and answerable(FakeTensorMode())
    with pytest.raises(InvalidArgumentError, match="shape environment"):
        MetaKernelCache(symbolic)
