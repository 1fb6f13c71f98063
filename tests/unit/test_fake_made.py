"""FakeMaker makes the fake tensors FakeTensor() makes, or lets FakeTensor() make them."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode

from memprof.simulate import fake_made
from memprof.simulate.fake_made import FakeMaker


def _meta(*size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with torch._C._DisableTorchDispatch():
        return torch.empty(size, dtype=dtype, device="meta")


def _alike(a: FakeTensor, b: FakeTensor) -> None:
    assert type(a) is type(b) is FakeTensor
    assert a.__dict__ == b.__dict__
    assert (a.device, a.dtype, a.shape, a.stride(), a.requires_grad) == (b.device, b.dtype, b.shape, b.stride(),
                                                                        b.requires_grad)
    assert torch._C._dispatch_keys(a) == torch._C._dispatch_keys(b)


def test_a_made_tensor_is_what_fake_tensor_makes_and_computes_as_one():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    make = FakeMaker(mode)
    for device in (torch.device("cpu"), torch.device("cpu")):  # the second from the kept attributes
        made, reference = make(_meta(3, 5), device), FakeTensor(mode, _meta(3, 5), device)
        _alike(made, reference)
    assert make._attributes[torch.device("cpu")] is not None  # checked, and kept
    a, b = make(_meta(3, 5), torch.device("cpu")), make(_meta(5, 2, dtype=torch.bfloat16), torch.device("cpu"))
    assert a.untyped_storage()._cdata != b.untyped_storage()._cdata  # each around its own meta storage
    with mode:
        out = a.to(torch.bfloat16) @ b
    _alike(out, FakeTensor(mode, _meta(3, 2, dtype=torch.bfloat16), torch.device("cpu")))
    # A memo of one tensor is its own: the attributes are copied, not shared.
    a.nonzero_memo = 7
    assert b.nonzero_memo is None and make(_meta(1), torch.device("cpu")).nonzero_memo is None


def test_fake_tensor_makes_them_where_the_copy_differs_or_tracebacks_are_kept(monkeypatch):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    monkeypatch.setattr(FakeTensorConfig, "debug", True)
    made = FakeMaker(mode)(_meta(2), torch.device("cpu"))
    assert "_debug_trace" in made.__dict__  # FakeTensor() made it, with its traceback
    monkeypatch.setattr(FakeTensorConfig, "debug", False)

    def plain_keys(cls, meta, grad, **kw):  # a torch whose FakeTensor makes its tensors otherwise
        return torch.Tensor._make_subclass(cls, meta, grad)

    monkeypatch.setattr(fake_made, "_MAKE", plain_keys)
    make = FakeMaker(mode)
    made = make(_meta(2), torch.device("cpu"))
    assert make._attributes[torch.device("cpu")] is None  # the check failed: FakeTensor() makes them all
    _alike(made, FakeTensor(mode, _meta(2), torch.device("cpu")))
