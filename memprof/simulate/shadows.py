"""Value shadows: the few values a shape-only simulation needs, kept beside its tensors.

A mixture-of-experts layer decides what to allocate from the router's choices: transformers' per-expert
loop (the ``"eager"`` experts implementation) asks which experts were hit (``nonzero``), iterates over them
and gathers each one's tokens (``torch.where``), and some models read counts with ``tolist()``. Shape-only
tensors have no values, so these ops cannot run on them. The router's choices are what the simulation
assumes (:mod:`memprof.simulate.routing`); from them on, every value is determined.

:class:`ShadowStore` keeps a small real CPU storage beside the data-less storage of each tensor whose values
follow from the routing ("its shadow"), keyed by storage so that views share it and in-place ops update
it. :class:`ValueShadows`, a dispatch mode beneath memprof's profiler, runs every op whose tensor inputs all
have shadows on the shadows too, gives its outputs theirs, and answers a value-dependent op (``nonzero``,
``item()``, ``tolist()``, ``repeat_interleave`` by a tensor ...) from them: the output's shape, or the Python
value. The shape-only op still makes the output, so memory is counted as before. Dense models never create
a shadow and pay one dictionary lookup per op.

The store never holds a data-less tensor, only weak references to storages: holding one would keep it
alive past its real lifetime and move the peaks the simulation measures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, TypeGuard

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from ..collect.module_table import tensors_in_args

from ..errors import is_interrupt
from .experts import EXCHANGE_OPS
from .grouped_mm import grouped_mm_output
from .op_chain import OpRule

if TYPE_CHECKING:
    from torch._ops import OpOverload

    from .aliases import OpValue
    from .op_chain import OpNext
    from .experts import CountsExchange

__all__ = ["ShadowStore", "ValueShadows", "shape_only"]

_aten = torch.ops.aten
_no_dispatch = torch._C._DisableTorchDispatch

#: Ops whose output shape or Python result depends on values: with shadows they are answered from them.
VALUE_DEPENDENT = frozenset({
    _aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default, _aten.unique_dim.default,
    _aten.unique_consecutive.default, _aten.repeat_interleave.Tensor, _aten.bincount.default,
    _aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default,
})
#: Factories whose values are known without data. Their shadows are made lazily, only when an op meets them
#: with a routing tensor (JetMoE's ``zeros(...).scatter(1, top_k_indices, 1)``, one_hot's ``zeros``).
KNOWN_VALUES = frozenset({
    _aten.zeros.default, _aten.ones.default, _aten.full.default, _aten.arange.default, _aten.arange.start,
    _aten.arange.start_step, _aten.scalar_tensor.default, _aten.zeros_like.default, _aten.ones_like.default,
    _aten.full_like.default, _aten.new_zeros.default, _aten.new_ones.default, _aten.new_full.default,
    _aten.eye.default,
})
#: How the notes name the value-dependent ops a Python user wrote.
_WORDS = {_aten._local_scalar_dense.default: "item()", _aten.is_nonzero.default: "bool()"}
#: The reads :attr:`ValueShadows.reads` answers where they fail.
_ANSWERED_READS = frozenset(_WORDS)
_PRUNE_EVERY = 1024  # slow-path ops between sweeps of storages that died


class _StorageRef(Protocol):
    """A weak reference to a storage: has the storage died?"""

    def expired(self) -> bool: ...


#: torch's StorageWeakRef, whose source has no annotations, typed here once.
_storage_ref: Callable[[torch.UntypedStorage], _StorageRef] = StorageWeakRef


def shape_only(t: object) -> TypeGuard[torch.Tensor]:
    """A tensor without data: a fake tensor or a meta tensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, torch.Tensor) and (isinstance(t, FakeTensor) or t.is_meta)


class ShadowStore:
    """Real CPU values for shape-only storages, keyed by storage and held only while the storage lives."""

    def __init__(self) -> None:
        self.shadows: dict[int, tuple[_StorageRef, torch.UntypedStorage]] = {}
        self.lazy: dict[int, tuple[_StorageRef, Callable[[], torch.Tensor]]] = {}
        #: True once a router call was answered: from then on factories are noted (a dense model never is).
        self.routed = False

    def get(self, t: torch.Tensor, make_lazy: bool = False) -> "torch.Tensor | None":
        """The values of shape-only ``t`` where the simulation has them (with ``make_lazy``, also a known
        factory's, made now), as a real tensor of ``t``'s layout; else None."""
        st = t.untyped_storage()
        key = st._cdata
        if make_lazy and key in self.lazy and key not in self.shadows:
            ref, thunk = self.lazy.pop(key)
            if not ref.expired():
                with _no_dispatch():
                    self.put(t, thunk())
        hit = self.shadows.get(key)
        if hit is None:
            return None
        if hit[0].expired():
            del self.shadows[key]
            return None
        with _no_dispatch():
            return torch.empty(0, dtype=t.dtype).set_(hit[1], t.storage_offset(), t.shape, t.stride())

    def put(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Give shape-only ``fake`` the values ``real`` (a real CPU tensor of its shape)."""
        st = fake.untyped_storage()
        with _no_dispatch():
            storage = torch.UntypedStorage(st.nbytes())  # type: ignore[no-untyped-call]  # its __init__ is untyped
            view = torch.empty(0, dtype=fake.dtype).set_(storage, fake.storage_offset(), fake.shape, fake.stride())
            try:
                view.copy_(real)
            except RuntimeError as failure:  # an overlapping layout (an expanded tensor): no values kept for it
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                return
        self.shadows[st._cdata] = (_storage_ref(st), storage)

    def drop(self, fake: torch.Tensor) -> None:
        """``fake`` was written with values the simulation does not have."""
        key = fake.untyped_storage()._cdata
        self.lazy.pop(key, None)
        self.shadows.pop(key, None)

    def note_factory(self, func: OpOverload, args: tuple[OpValue, ...], kwargs: dict[str, OpValue], out: OpValue
                     ) -> None:
        """Remember how to make the values of factory output ``out``, without holding any shape-only tensor."""
        if not shape_only(out):
            return
        # *_like / new_* take a tensor for its layout only: keep the layout and rebuild a real empty of it.
        def layout(a: object) -> object:
            return _Layout(tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor) else a

        kept = pytree.tree_map(layout, (tuple(args), {k: v for k, v in kwargs.items() if k != "device"}))

        def thunk() -> torch.Tensor:
            a, k = pytree.tree_map(lambda x: x.real() if isinstance(x, _Layout) else x, kept,
                                   is_leaf=lambda x: isinstance(x, _Layout))
            made: torch.Tensor = func(*a, **k, device="cpu") if _takes_device(func) else func(*a, **k)
            return made

        self.lazy[out.untyped_storage()._cdata] = (_storage_ref(out.untyped_storage()), thunk)

    def prune(self) -> None:
        self.shadows = {k: v for k, v in self.shadows.items() if not v[0].expired()}
        self.lazy = {k: v for k, v in self.lazy.items() if not v[0].expired()}


class _Layout:
    __slots__ = ("shape", "stride", "dtype")

    def __init__(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.stride, self.dtype = shape, stride, dtype

    def real(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype)


def _takes_device(func: OpOverload) -> bool:
    return any(a.name == "device" for a in func._schema.arguments)


def _written(func: OpOverload, args: tuple[OpValue, ...], kwargs: dict[str, OpValue]) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place (its schema's mutable arguments)."""
    where = _WRITES.get(func)
    if where is None:
        where = _WRITES[func] = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                                      if a.alias_info is not None and a.alias_info.is_write)
    out: list[torch.Tensor] = []
    for i, name in where:
        out.extend(tensors_in_args(args[i] if i < len(args) else kwargs.get(name), None))
    return out


# Per op: the positions and names of the arguments its schema says it writes.
_WRITES: "dict[OpOverload, tuple[tuple[int, str], ...]]" = {}


class ValueShadows(OpRule):
    """A rule of a simulation's ops (:class:`~memprof.simulate.op_chain.OpRule`): the target's ``_grouped_mm``
    (:mod:`memprof.simulate.grouped_mm`), and value shadows (the module's docstring). ``target`` is the device type
    the figures are for."""

    def __init__(self, target: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is untyped
        self.target = target
        self.store = ShadowStore()
        self.grouped_mm = 0  # _grouped_mm calls simulated
        self.answered: dict[str, int] = {}  # value-dependent ops answered from shadows, by name
        self._slow = 0
        #: Answers an expert-parallel all-to-all of counts (:mod:`memprof.simulate.experts`); None: run as is.
        self.exchange: "CountsExchange | None" = None
        #: Answers a value read (``item()``, ``bool()``) that failed, or raises its failure again
        #: (:meth:`memprof.simulate.user_step.LoopValues.answer`: a user's step's reads outside the model, memprof's
        #: loop's optimizer step's); None: none.
        self.reads: "Callable[[OpOverload, tuple[OpValue, ...], BaseException], OpValue] | None" = None

    def handle(self, func: OpOverload, args: tuple[OpValue, ...], kwargs: dict[str, OpValue],
               next: OpNext) -> OpValue:
        if func is _aten._grouped_mm.default:
            self.grouped_mm += 1
            return grouped_mm_output(*args, **kwargs)
        store = self.store
        if func in KNOWN_VALUES:
            out = next(func, args, kwargs)
            if store.routed and out is not NotImplemented:  # (a subclass's call, handed back: op_chain.OpChain)
                store.note_factory(func, args, kwargs, out)
            return out
        if self.reads is not None and func in _ANSWERED_READS:
            try:
                return next(func, args, kwargs) if not store.shadows else self._shadowed(func, args, kwargs, next)
            except (RuntimeError, NotImplementedError) as failure:  # fake: data-dependent; meta: "cannot be called"
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                return self.reads(func, args, failure)
        if not store.shadows:
            return next(func, args, kwargs)
        return self._shadowed(func, args, kwargs, next)

    def _shadowed(self, func: OpOverload, args: tuple[OpValue, ...], kwargs: dict[str, OpValue],
                  next: OpNext) -> OpValue:
        store = self.store
        self._slow += 1
        if self._slow % _PRUNE_EVERY == 0:
            store.prune()
        if self.exchange is not None and func in EXCHANGE_OPS:
            # Received values come from the other ranks, not from these inputs: the routing assumption says them.
            # (A collective: no rule beneath this one is about it, so the exchange calls it itself.)
            return self.exchange.answer(func, args, kwargs, store)
        tensors = tensors_in_args(args, kwargs)  # pytree's leaves that are tensors, at a tenth of its cost per op
        values = [store.get(t) if shape_only(t) else None for t in tensors]
        if not any(v is not None for v in values):
            out = next(func, args, kwargs)
            if store.lazy:
                for t in _written(func, args, kwargs):  # a factory's output written with unknown values
                    store.lazy.pop(t.untyped_storage()._cdata, None)
            return out
        # A routing tensor meets others: a known factory's get its values now.
        values = [v if v is not None or not shape_only(t) else store.get(t, make_lazy=True)
                  for t, v in zip(tensors, values)]
        if not all(v is not None for v in values):
            out = next(func, args, kwargs)
            for t in _written(func, args, kwargs):  # written with values the simulation does not have
                store.drop(t)
            return out
        swap = {id(t): v for t, v in zip(tensors, values)}
        real_args, real_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: swap[id(t)], (args, kwargs))
        try:
            with _no_dispatch():
                real_out = func(*real_args, **real_kwargs)
        except (RuntimeError, NotImplementedError) as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            # The shadows are CPU tensors; a CUDA target's code may ask what the CPU has no kernel for (histc of
            # ints, transformers' CUDA path). Values are lost there, never the shape-only op.
            if func in VALUE_DEPENDENT:
                raise
            out = next(func, args, kwargs)
            for t in _written(func, args, kwargs):
                store.drop(t)
            return out
        if func in VALUE_DEPENDENT:
            name = _WORDS.get(func, str(func.overloadpacket).replace("aten.", ""))
            self.answered[name] = self.answered.get(name, 0) + 1
            if not isinstance(real_out, (torch.Tensor, tuple, list)):
                return real_out  # item(), is_nonzero(), equal(): the Python value
            device = tensors[0].device
            shaped = pytree.tree_map_only(torch.Tensor, lambda r: torch.empty_strided(
                r.shape, r.stride(), dtype=r.dtype, device=device), real_out)
        else:
            shaped = next(func, args, kwargs)
        for f, r in zip(pytree.tree_leaves(shaped), pytree.tree_leaves(real_out)):
            if shape_only(f) and isinstance(r, torch.Tensor) and store.get(f) is None:
                store.put(f, r)
        return shaped
