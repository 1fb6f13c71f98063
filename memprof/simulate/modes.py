"""One torch function mode for everything a simulation changes or watches above the ops.

A simulation applies several rules to the torch functions a model calls: CUDA's autocast policy
(:mod:`memprof.simulate.autocast`), CUDA's kernel choices and the watchers of value-dependent code and
custom ops (:mod:`memprof.simulate.kernels`). Stacked as separate modes they would hide calls from each
other: re-entering a mode so that it sees the calls inside a Python composite
(``F.multi_head_attention_forward``) or inside backward (checkpoint recomputation) skips every mode
beneath it for that call. So each rule is a :class:`Rule`, and :class:`Rules` runs them as one mode,
in order, each handing the call on to the next.

The rules are about the model's calls. A tensor's metadata read, memprof's own bookkeeping and torch's own ops
called as ops go past them (:data:`TORCH_NAMESPACES` and the lists below), and in a simulation nothing beneath the
collector's dispatch handler reaches the mode at all (``memprof.collect.simulated.SimulatedDispatchMode``).
"""

from __future__ import annotations

import functools
import os
import sys
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Callable

import torch
from torch._ops import OpOverload
from torch.overrides import TorchFunctionMode

from . import held_signals

if TYPE_CHECKING:
    from .aliases import OpValue

__all__ = ["Rule", "Rules", "Next", "TORCH_NAMESPACES"]

#: What a rule calls to hand a call on: ``next(func, args, kwargs)``, with the torch function (any callable torch
#: hands a function mode: a function of torch, a tensor method, a property's getter) and its arguments.
Next = Callable[[Callable[..., "OpValue"], "tuple[OpValue, ...]", "dict[str, OpValue]"], "OpValue"]

# Python modules whose functions are compositions of other torch functions.
_COMPOSITE_MODULES = frozenset({"torch.nn.functional", "torch.functional"})
# Calls during which the rules must stay on: backward recomputes checkpointed regions, which must run their
# forward as the first pass ran it (torch.utils.checkpoint checks what they save).
_FOLLOWED = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})

# What a tensor is, read through a property's getter or a method that runs no op and returns no tensor: no rule
# answers them (none makes or casts a tensor), and they were 40 % of the calls a simulation's mode saw. (The watcher
# of value-dependent code counted them among the "ops" its note names; they build nothing, and it no longer does.)
_GETTERS = ("shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad_fn", "_version",
            "output_nr", "names", "itemsize", "nbytes", "is_meta", "is_cpu", "is_cuda", "is_sparse", "is_quantized",
            "is_nested", "is_mkldnn")
_METHODS = ("dim", "size", "stride", "numel", "element_size", "storage_offset", "is_floating_point", "is_complex",
            "is_contiguous", "untyped_storage", "get_device", "_is_view", "is_inference")
# A tensor's gradient, data and base read or set: no op runs either (``.T``, ``.real`` and the like run one).
_KEPT_TENSORS = ("grad", "data", "_base")
_METADATA = frozenset([getattr(torch._C.TensorBase, n).__get__ for n in _GETTERS + _KEPT_TENSORS
                       if hasattr(torch._C.TensorBase, n)]
                      + [getattr(torch._C.TensorBase, n).__set__ for n in ("grad", "data")]
                      + [getattr(torch._C.TensorBase, n) for n in _METHODS if hasattr(torch._C.TensorBase, n)])
#: Namespaces of torch's own ops, whose meta kernels are torch's statement of what the device allocates (fsdp:
#: FSDP2's copy-in and copy-out ops, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). Called as ops
#: (``torch.ops.aten.mm.default(...)``: a dispatch mode handing an op on, a fake or meta kernel, a decomposition)
#: they go past the rules, which are about the functions above them; another namespace's op is a custom op, which
#: the custom-op watcher counts (:class:`memprof.simulate.kernels.CustomOps`).
TORCH_NAMESPACES = frozenset({"aten", "prim", "prims", "_c10d_functional", "_c10d_functional_autograd", "c10d",
                              "profiler", "higher_order", "fsdp", "_dtensor"})
# memprof's own bookkeeping, which runs inside the simulated step (the ledger, the dispatch mode's handler and its
# redispatch of each op, the hooks on modules, saved tensors, gradients and the optimizer): the rules are about
# the model's calls, and these were a third of the calls the mode saw. Known by the module's name and its file, in
# memprof's own folders: a user's module named under memprof's package is still the model's code.
_BOOKKEEPING = ("memprof.collect.", "memprof.record.")
_BOOKKEEPING_FILES = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), folder, "")
                           for folder in ("collect", "record"))


def _bookkeeping(frame: FrameType) -> bool:
    """Whether ``frame`` runs memprof's bookkeeping (:data:`_BOOKKEEPING`, from :data:`_BOOKKEEPING_FILES`)."""
    return (frame.f_globals.get("__name__", "").startswith(_BOOKKEEPING)
            and os.path.abspath(frame.f_code.co_filename).startswith(_BOOKKEEPING_FILES))


class Rule(TorchFunctionMode):
    """A rule about torch function calls. Alone it is a mode of its own; within :class:`Rules` it is
    one link of a chain. Subclasses implement :meth:`handle`."""

    #: The chain this rule is a link of (set by :class:`Rules`), whose :meth:`Rules.caller` gives the frame that
    #: called the torch function; None alone.
    chain: "Rules | None" = None

    def handle(self, func: Callable[..., OpValue], args: tuple[OpValue, ...], kwargs: dict[str, OpValue],
               next: Next) -> OpValue:
        return next(func, args, kwargs)

    def caller(self) -> "FrameType | None":
        """The frame that called the torch function being handled (or, alone, the handler's caller's)."""
        return self.chain.caller() if self.chain is not None else sys._getframe(2)

    def __torch_function__(self, func: Callable[..., OpValue], types: tuple[type, ...],
                           args: tuple[OpValue, ...] = (), kwargs: "dict[str, OpValue] | None" = None) -> OpValue:
        return self.handle(func, tuple(args), dict(kwargs or {}),
                           lambda f, a, k: follow(self, f, types, a, k))


class Rules(TorchFunctionMode):
    """Several :class:`Rule` objects as one mode, applied in the order given.

    The chain is built once: rule ``i``'s ``next`` is rule ``i + 1``'s ``handle`` bound to its own ``next``
    (a ``functools.partial``, no Python frame), the last one's :func:`follow`. A simulation calls a torch function
    tens of thousands of times per step, so the chain makes no closure per call; what differs per call (the
    ``types`` :func:`follow` hands on, the caller's frame) is kept on the mode for the call's duration and put
    back after it, since a followed composite re-enters the mode."""

    def __init__(self, *rules: Rule) -> None:
        super().__init__()
        self.rules = rules
        self._types: tuple[type, ...] = ()
        self._caller: "FrameType | None" = None
        self._own: dict[CodeType, bool] = {}  # per code object: is it memprof's bookkeeping (_BOOKKEEPING)?
        # Per op, by id (OpOverload.__hash__ is a Python method): the op, and whether it is torch's own.
        self._ops: dict[int, tuple[object, bool]] = {}
        link: Next = self._follow
        for rule in reversed(rules):
            rule.chain = self
            link = functools.partial(rule.handle, next=link)
        self._first = link

    def _follow(self, func: Callable[..., OpValue], args: tuple[OpValue, ...], kwargs: dict[str, OpValue]) -> OpValue:
        return follow(self, func, self._types, args, kwargs)

    def caller(self) -> "FrameType | None":
        return self._caller

    def __enter__(self) -> "Rules":
        held_signals.enter()  # a signal's exception inside torch's C++ would abort the process (held_signals.py)
        try:
            return super().__enter__()  # type: ignore[no-untyped-call, no-any-return]  # TorchFunctionMode's is untyped
        except BaseException:
            held_signals.leave()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            _pop_through(self)
        finally:
            held_signals.leave()

    def __torch_function__(self, func: Callable[..., OpValue], types: tuple[type, ...],
                           args: tuple[OpValue, ...] = (), kwargs: "dict[str, OpValue] | None" = None) -> OpValue:
        caller = sys._getframe(1)
        own = self._own.get(caller.f_code)
        if own is None:
            own = self._own[caller.f_code] = _bookkeeping(caller)
        if not own and type(func) is OpOverload:
            known = self._ops.get(id(func))
            if known is None or known[0] is not func:
                known = self._ops[id(func)] = (func, func.namespace in TORCH_NAMESPACES)
            own = known[1]
        if own or func in _METADATA:
            # No rule applies (_METADATA, TORCH_NAMESPACES, _BOOKKEEPING): called as the chain's end calls it.
            held_signals.hold()
            try:
                return func(*args, **kwargs) if kwargs else func(*args)
            finally:
                held_signals.release()
        outer = self._types, self._caller
        self._types, self._caller = types, caller
        held_signals.hold()
        try:
            return self._first(func, tuple(args), dict(kwargs or {}))
        finally:
            self._types, self._caller = outer
            held_signals.release()


def _pop_through(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off the function-mode stack, and the modes above it first: torch's own ``__exit__`` pops the
    top, whichever it is, and a mode whose entry an interrupt cut short after its push (its exit never
    registered) sits above this one; popping blindly then takes this mode's place off the stack, and the exits
    below it pop the wrong modes in turn, until one finds the stack empty ("trying to pop from empty mode
    stack", seen once in 300 interrupted estimates under load). ``mode`` not on the stack: nothing is popped."""
    depth = torch._C._len_torch_function_stack()
    for i in range(depth - 1, -1, -1):
        if torch._C._get_function_stack_at(i) is mode:
            for _ in range(depth - i):
                torch._C._pop_torch_function_stack()
            return


def follow(mode: TorchFunctionMode, func: Callable[..., OpValue], types: tuple[type, ...], args: tuple[OpValue, ...],
           kwargs: dict[str, OpValue]) -> OpValue:
    """Call ``func`` from ``mode``'s handler. A Python composite of ``torch.nn.functional`` runs with
    ``mode`` still on for the functions it calls, as a dispatch key would see them, and so does backward,
    for the recomputation of checkpointed regions. (Tensor methods written in Python call back into the
    same method through ``super()``: following them would recurse, and they call nothing a rule changes.)"""
    skip = getattr(torch._C, "_skip_one_hop_torch_function", None)
    if skip is None or (func not in _FOLLOWED and getattr(func, "__module__", None) not in _COMPOSITE_MODULES):
        # Older torch has no way to re-enter: the functions inside a Python composite are not seen.
        return func(*args, **kwargs)
    with mode:
        return skip(func, types, args, kwargs)
