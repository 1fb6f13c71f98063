"""What a caching allocator would record for CPU tensors, emitted into the stand-in (``allocator_stand_in``), so that
``source="allocator"`` runs its whole path on CPU: an ``alloc`` entry for every new storage an op returns, and a
``free_requested`` entry when that storage dies (a weak reference's callback, as torch frees it).

A test-only dispatch mode: memprof's ``source="allocator"`` installs none, and this one stands for the C++
allocator, beneath the profile."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from allocator_stand_in import FakeAllocator

_LIFT_FRESH = torch.ops.aten.lift_fresh.default


class StorageEvents(TorchDispatchMode):
    """Emits into ``fake`` the allocation of each storage an op makes and its free. A storage counts with its
    ``nbytes()``: the reducer rounds as the profile's ledger does (no rounding on CPU)."""

    def __init__(self, fake: FakeAllocator) -> None:
        super().__init__()
        self.fake = fake
        self.refs: dict[int, weakref.ref] = {}  # storage key -> a reference whose callback emits the free

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # lift_fresh hands dispatch a tensor built in C++ (torch.tensor): its storage is new, though also its input's
        given = set() if func is _LIFT_FRESH else {
            t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen(t, given)
        return out

    def seen(self, t: torch.Tensor, given: "set[int]") -> None:
        st = t.untyped_storage()
        key, addr, nbytes = st._cdata, st.data_ptr(), st.nbytes()
        if key in self.refs or key in given or not addr or not nbytes:
            return  # a view, an in-place op's result, an empty storage: nothing allocated
        fake, refs = self.fake, self.refs

        def freed(_ref, key=key, addr=addr, nbytes=nbytes) -> None:
            refs.pop(key, None)
            fake.emit("free_requested", addr, nbytes)

        refs[key] = weakref.ref(st, freed)
        fake.emit("alloc", addr, nbytes)
