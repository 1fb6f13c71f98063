"""Fake tensors made around meta tensors at a third of ``FakeTensor()``'s cost.

:class:`~memprof.simulate.meta_kernels.MetaKernelCache` answers most of a simulation's ops on fake tensors with new
fake tensors (26,000 in one cut of a Llama-3-8B pipeline stage). ``FakeTensor.__new__`` spends most of its
9 us on what is the same for every tensor of one mode and device: its keyword handling, the device's
normalisation (``FakeTensor._normalize_fake_device``) and fifteen attribute writes through the memo descriptors
(``SymNumberMemoDescriptor.__set__``), each of which writes three attributes of ``None``. :class:`FakeMaker` makes
the subclass instance as ``__new__`` does (``Tensor._make_subclass`` with the fake device's dispatch keys, the
mutable-data-pointer flag the mode asks for) and copies the attributes of a tensor ``FakeTensor()`` made for the
same mode and device.

Whether the copy is what ``FakeTensor()`` makes is checked, not assumed: for each (mode, device) the first
tensor is made both ways and compared (type, device, dispatch keys, every attribute); where any differs (another
torch's ``FakeTensor``, its debug tracebacks on) ``FakeTensor()`` makes every tensor of that mode and device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["FakeMaker", "meta_empty"]

_MAKE = torch.Tensor._make_subclass


class FakeMaker:
    """Fake tensors of ``mode`` around meta tensors, as ``FakeTensor(mode, meta, device)`` makes them."""

    def __init__(self, mode: "FakeTensorMode") -> None:
        self.mode = mode
        # Per device: the attributes FakeTensor() gives a tensor of this mode (None: FakeTensor() makes them).
        self._attributes: "dict[torch.device, dict[str, object] | None]" = {}

    def __call__(self, meta: torch.Tensor, device: "torch.device | None") -> FakeTensor:
        if device is None:  # as FakeTensor() takes it (it refuses it)
            return FakeTensor(self.mode, meta, device)
        if device not in self._attributes:
            self._attributes[device] = self._checked(meta, device)
        attributes = self._attributes[device]
        if attributes is None:
            return FakeTensor(self.mode, meta, device)
        return self._made(meta, device, attributes)

    def _made(self, meta: torch.Tensor, device: torch.device, attributes: "dict[str, object]") -> FakeTensor:
        out: FakeTensor = _MAKE(FakeTensor, meta, meta.requires_grad, dispatch_device=True,
                                device_for_backend_keys=device)
        if self.mode._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(out)
        else:
            torch._C._set_throw_on_mutable_data_ptr(out)
        out.__dict__.update(attributes)
        return out

    def _checked(self, meta: torch.Tensor, device: torch.device) -> "dict[str, object] | None":
        """The attributes ``FakeTensor()`` gives a tensor of this mode on ``device``, where a tensor made with them
        is what it makes; None where not."""
        if FakeTensorConfig.debug:
            return None  # each tensor keeps its own traceback
        reference = FakeTensor(self.mode, meta_empty(tuple(meta.shape), meta.stride(), meta.dtype), device)
        attributes = dict(reference.__dict__)
        if any(isinstance(v, torch.Tensor) for v in attributes.values()):
            return None  # a tensor of its own per fake tensor: not shared
        made = self._made(meta_empty(tuple(meta.shape), meta.stride(), meta.dtype), device, attributes)
        same = (type(made) is type(reference) and made.__dict__ == reference.__dict__
                and made.device == reference.device and made.requires_grad == reference.requires_grad
                and torch._C._dispatch_keys(made) == torch._C._dispatch_keys(reference))
        return attributes if same else None


def meta_empty(size: "tuple[int, ...]", stride: "tuple[int, ...]", dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of this metadata, made beneath every dispatch mode (a fake mode would make it a fake one)."""
    with torch._C._DisableTorchDispatch():
        return torch.empty_strided(size, stride, dtype=dtype, device="meta")
