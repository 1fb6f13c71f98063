"""The rules of a mixture-of-experts simulation above the ops: router calls and ``one_hot``.

:class:`Router` answers every router call inside the model's forward (``topk`` or ``argmax`` over floating
scores without values) with indices from the routing assumption (:mod:`memprof.simulate.routing`), kept as
the indices' value shadow (:mod:`memprof.simulate.shadows`). The same calls are what
``memprof.profile(..., record_routing=True)`` records in a real run (:mod:`memprof.collect.routing`), so a
recorded routing replays call for call. Calls outside any module's forward (a generation loop's argmax,
a metric in the loss function) are no routing and keep no values.

:class:`OneHot` runs ``F.one_hot`` as the target's kernel does (``aten/src/ATen/native/Onehot.cpp``): on a
CPU, ``aminmax`` of the classes (two 8-byte tensors) for its checks, then ``zeros`` and ``scatter_``; on
CUDA, ``zeros`` and ``scatter_`` only. On fake and meta tensors torch runs a decomposition instead
(``torch/_decomp/decompositions.py``, ``one_hot``: an ``arange``, an ``eq`` and a cast), whose temporaries
differ: in DeepSeek-V3's prefill the one-hot of 257 classes can be the step's peak.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from ..collect.routing import ROUTER_FUNCTIONS, innermost_module, router_call
from .modes import Next, Rule
from .routing import RoutingPlan
from .shadows import ShadowStore, shape_only

if TYPE_CHECKING:
    from .aliases import OpValue

__all__ = ["Router", "OneHot", "innermost_module"]

class Router(Rule):
    """Router calls answered from a :class:`~memprof.simulate.routing.RoutingPlan`. ``where`` gives the
    innermost running module's path (None outside the model's forward)."""

    def __init__(self, plan: RoutingPlan, store: ShadowStore) -> None:
        super().__init__()
        self.plan, self.store = plan, store
        self.where: Callable[[], "str | None"] = lambda: None
        self.modules: Counter[str] = Counter()

    def handle(self, func: Callable[..., OpValue], args: tuple[OpValue, ...], kwargs: dict[str, OpValue],
               next: Next) -> OpValue:
        out = next(func, args, kwargs)
        if func not in ROUTER_FUNCTIONS:
            return out
        call = router_call(func, args, kwargs, out)
        if call is None:
            return out
        scores, idx, dim, keepdim = call
        if not shape_only(scores) or self.store.get(scores) is not None:
            return out  # scores with values: the op itself ran on them
        module = self.where()
        if module is None:
            return out
        shape = list(idx.shape)
        if not keepdim:
            shape.insert(dim, 1)
        chosen = self.plan.indices(tuple(shape), scores.shape[dim] if scores.dim() else 1, dim, module)
        with torch._C._DisableTorchDispatch():  # a real tensor: the simulation's modes must not make it fake
            chosen = chosen.reshape(idx.shape)
        self.store.routed = True
        self.store.put(idx, chosen)
        self.modules[module] += 1
        return out


class OneHot(Rule):
    """``F.one_hot`` on shape-only tensors as the target's kernel runs it (the module's docstring).
    ``target`` is ``"cpu"`` or another device type (the CUDA kernel's path)."""

    def __init__(self, target: str, store: ShadowStore) -> None:
        super().__init__()
        self.target, self.store = target, store
        self.calls = 0

    def handle(self, func: Callable[..., OpValue], args: tuple[OpValue, ...], kwargs: dict[str, OpValue],
               next: Next) -> OpValue:
        if func is not F.one_hot or not args or not shape_only(args[0]):
            return next(func, args, kwargs)
        x = args[0]
        classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        if x.dtype != torch.long or x.numel() == 0:
            return next(func, args, kwargs)  # torch's own error, or its empty result
        known = self.store.get(x) is not None
        if classes == -1 and not known:
            return next(func, args, kwargs)  # the classes are read from values nobody has: torch's error
        self.calls += 1
        if self.target == "cpu":
            low, high = torch.aminmax(x)
            if known:  # the kernel's checks read the values; without them they allocate nothing more
                if low.item() < 0:
                    raise RuntimeError("Class values must be non-negative.")
                top = high.item()
                if classes == -1:
                    classes = int(top) + 1
                elif top >= classes:
                    raise RuntimeError("Class values must be smaller than num_classes.")
            del low, high
        elif classes == -1:
            classes = int(x.max().item()) + 1
        out = torch.zeros((*x.shape, classes), dtype=torch.long, device=x.device)
        out.scatter_(-1, x.unsqueeze(-1), 1)
        return out

    def notes(self) -> list[str]:
        return []
