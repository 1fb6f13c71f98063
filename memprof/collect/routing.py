"""Recording a real run's routing: ``memprof.profile(..., record_routing=True)``.

A router call is a ``topk``, or an ``argmax`` along a dimension, over floating scores, made inside the
model's forward (the innermost running module is the router). Every mixture-of-experts model of
transformers 5 routes this way (``torch.topk`` over the router's logits or probabilities, DeepSeek-V3's group
choice included); a generation loop's own argmax or a metric in the loss function runs outside the forward
and is no router. :class:`RoutingRecorder` keeps each call's per-choice token counts
(:class:`~memprof.record.routing.RoutingRecord`), which is what a simulation needs to replay the routing
(``memprof.estimate(..., routing=report)``): the same calls, recognised by :func:`router_call`, are the ones
it answers.

The counts are taken on a host copy of the indices, under no dispatch mode: nothing is added to the
device's memory, and memprof's own accounting never sees them. On an accelerator that copy waits for the
device at every router call, so recording slows a run; it is off by default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch.overrides import TorchFunctionMode

from ..record.routing import MAX_ROUTER_CALLS, RouterCall, RoutingRecord

if TYPE_CHECKING:
    from .aliases import Kwargs, OpValue
    from .module_table import ModuleTable
    from .state import Run

__all__ = ["RoutingRecorder", "router_call", "ROUTER_FUNCTIONS"]

_TOPK = (torch.topk, torch.Tensor.topk)
_ARGMAX = (torch.argmax, torch.Tensor.argmax)
#: The torch functions a router calls.
ROUTER_FUNCTIONS = frozenset(_TOPK + _ARGMAX)


def router_call(func: Callable[..., object], args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]",
                out: "OpValue") -> "tuple[torch.Tensor, torch.Tensor, int, bool] | None":
    """``(scores, indices, dim, keepdim)`` when ``func(*args, **kwargs) -> out`` chose indices from floating
    scores (a ``topk``, or an ``argmax`` along a dimension); None otherwise."""
    if func in _TOPK:
        x = args[0]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        return (x, out[1], dim % max(x.dim(), 1), True) if x.is_floating_point() else None
    if func in _ARGMAX:
        x = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is None or not x.is_floating_point():
            return None
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        return x, out, dim % max(x.dim(), 1), bool(keepdim)
    return None


def innermost_module(run: "Run", table: "ModuleTable") -> "str | None":
    """The path of the innermost module whose forward is running in ``run``; None outside the model."""
    calls = run.calls
    return table.info[calls[-1]].path if calls else None


class RoutingRecorder(TorchFunctionMode):
    """Counts each router call's choices while the profile runs (the module's docstring)."""

    def __init__(self, run: "Run", table: "ModuleTable") -> None:
        super().__init__()
        self.run = run
        self.table = table
        self.calls: list[RouterCall] = []
        self.truncated = False

    # TorchFunctionMode leaves these untyped: the torch function, the types of the tensors among its arguments, and
    # its arguments, which this handler passes on.
    def __torch_function__(self, func: Callable[..., object], types: "tuple[type, ...]",
                           args: "tuple[object, ...]" = (), kwargs: "Kwargs | None" = None) -> object:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in ROUTER_FUNCTIONS and self.run.active:
            self._note(func, tuple(args), kwargs, out)
        return out

    def _note(self, func: Callable[..., object], args: "tuple[object, ...]", kwargs: "Kwargs", out: object) -> None:
        call = router_call(func, args, kwargs, out)
        if call is None:
            return
        scores, idx, dim, keepdim = call
        module = innermost_module(self.run, self.table)
        if module is None:
            return
        if len(self.calls) >= MAX_ROUTER_CALLS:
            self.truncated = True
            return
        choices = scores.shape[dim] if scores.dim() else 1
        picks = idx.shape[dim] if keepdim and idx.dim() else 1
        with torch._C._DisableTorchDispatch():
            counts = torch.bincount(idx.detach().reshape(-1).cpu(), minlength=choices).tolist()
        self.calls.append(RouterCall(module, choices, picks, tuple(counts)))

    def record(self) -> RoutingRecord:
        return RoutingRecord(tuple(self.calls), self.truncated)
