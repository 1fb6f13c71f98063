"""One dispatch mode for every rule a simulation applies to ops beneath the collector.

Beneath memprof's collector a simulated op meets several rules: a tensor-parallel ``wait_tensor`` returned as its
input (:class:`~memprof.simulate.parallel.WaitIdentity`), the routing values kept beside shape-only tensors
(:class:`~memprof.simulate.shadows.ValueShadows`), the storage a CPU's or a sparse kernel gives its outputs
(:mod:`memprof.simulate.cpu_kernels`, :mod:`memprof.simulate.sparse_kernels`) and the fake kernels' answers kept
(:class:`~memprof.simulate.meta_kernels.MetaKernelCache`). Each a dispatch mode of its own, every op crossed
torch's Python dispatch once per rule (a mode popped, its handler called, the op dispatched again beneath it):
about a tenth of a simulation's time each. So each rule is an
:class:`OpRule`, and :class:`OpChain` runs them as one mode, in order, each handing the op on to the next, the last
to the modes beneath (the fake-tensor mode).

What a rule's handler calls itself (an empty tensor made for a shadowed answer) goes past the chain, as it went
past the modes above the rule's own before; the rules beneath it are about an op's outputs (their storage, their
values, a kernel's cached answer), not about such tensors, and the fake mode beneath still makes them.

A rule may answer ``NotImplemented`` (the kept answers do, for a call on a DTensor, as the fake mode would): the
rules before it hand that back untouched, and torch then runs the subclass's own handler, whose ops on its local
tensors come through the whole chain again, as those of a subclass the collector hands on always did.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

from ..collect.simulated import PRIM_DEVICE, fake_device
from ..collect.torch_compat import UnwrappedMode

if TYPE_CHECKING:
    from torch._ops import OpOverload

    from .aliases import OpValue

__all__ = ["OpNext", "OpRule", "OpChain", "call"]

#: What a rule calls to hand an op on: ``next(func, args, kwargs)``.
OpNext = Callable[["OpOverload", "tuple[OpValue, ...]", "dict[str, OpValue]"], "OpValue"]


def call(func: "OpOverload", args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]") -> "OpValue":
    """The end of every chain: the op dispatched to the modes beneath it."""
    return func(*args, **kwargs)


class OpRule(UnwrappedMode):
    """A rule about the ops a simulation runs. Alone it is a dispatch mode of its own, whose op goes on to the modes
    beneath it; within an :class:`OpChain` it is one link. Subclasses implement :meth:`handle`, and hand the op on
    through ``next``, never by calling it (that would skip the rules after them in a chain)."""

    def handle(self, func: "OpOverload", args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]",
               next: OpNext) -> "OpValue":
        return next(func, args, kwargs)

    def __torch_dispatch__(self, func: "OpOverload", types: object, args: "tuple[OpValue, ...]" = (),
                           kwargs: "dict[str, OpValue] | None" = None) -> "OpValue":
        return self.handle(func, args, kwargs or {}, call)


class OpChain(UnwrappedMode):
    """``rules`` as one dispatch mode, the first applied first (the outermost). The chain is built once: rule
    ``i``'s ``next`` is rule ``i + 1``'s ``handle`` bound to its own ``next`` (a ``functools.partial``, no Python
    frame), the last one's :func:`call`."""

    def __init__(self, *rules: OpRule) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is untyped
        link: OpNext = call
        for rule in reversed(rules):
            link = functools.partial(rule.handle, next=link)
        self._first = link

    def __torch_dispatch__(self, func: "OpOverload", types: object, args: "tuple[OpValue, ...]" = (),
                           kwargs: "dict[str, OpValue] | None" = None) -> "OpValue":
        # A fake tensor's device asked from C++ beneath the collector (its handler reads each output's is_cpu): no
        # rule is about it, and the fake mode answers it from the same field.
        if func is PRIM_DEVICE:
            device = fake_device(args)
            if device is not None:
                return device
        return self._first(func, args, kwargs or {})
