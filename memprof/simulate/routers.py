"""The rules of a mixture-of-experts simulation above the ops: router calls, ``one_hot`` and routed values formatted.

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
differ: in DeepSeek-V3's prefill the one-hot of 257 classes can be the step's peak. It also formats a routed
0-dim tensor as a real one formats (``Tensor.__format__``, torch/_tensor.py: its value's format), where a fake
tensor formats as its repr: SwitchTransformers picks each expert module by name, ``self[f"expert_{expert_idx[0]}"]``,
and the lookup failed with a KeyError.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from ..collect.routing import ROUTER_FUNCTIONS, innermost_module, router_call
from ..errors import SimulationError
from .modes import Next, Rule
from .routing import RoutingPlan
from .shadows import ShadowStore, shape_only

if TYPE_CHECKING:
    from .aliases import OpValue

__all__ = ["Router", "RoutedValues", "innermost_module"]

_FORMAT = torch.Tensor.__format__

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


class RoutedValues(Rule):
    """What code does with the routed values of shape-only tensors (the module's docstring): ``F.one_hot`` as the
    target's kernel runs it (``target`` is ``"cpu"`` or another device type, the CUDA kernel's path), and
    ``format()`` of a routed 0-dim tensor. One rule for both: the rule chain costs a frame per torch call."""

    def __init__(self, target: str, store: ShadowStore) -> None:
        super().__init__()
        self.target, self.store = target, store
        self.calls = 0

    def handle(self, func: Callable[..., OpValue], args: tuple[OpValue, ...], kwargs: dict[str, OpValue],
               next: Next) -> OpValue:
        if func is _FORMAT:
            return self._formatted(args, kwargs, next)
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

    def _formatted(self, args: tuple[OpValue, ...], kwargs: dict[str, OpValue], next: Next) -> OpValue:
        """A routed 0-dim tensor formatted as torch formats a real one: ``item().__format__(spec)``."""
        t = args[0]
        values = self.store.get(t) if shape_only(t) and t.dim() == 0 else None
        spec = args[1] if len(args) > 1 else kwargs.get("format_spec", "")
        if values is None:
            if spec and shape_only(t) and t.dim() == 0:
                # A real 0-dim tensor formats its value, which a shape-only one does not have: where the format asks
                # for a number (f"{loss:.3f}"), torch's own TypeError came out of the model's code.
                raise SimulationError(f"the model formats a tensor's value into a string (format spec {spec!r}), "
                                      "which shape-only tensors do not have; keep that formatting (a log line) out "
                                      "of the training step, or format a Python number")
            return next(_FORMAT, args, kwargs)
        with torch._C._DisableTorchDispatch():  # a real tensor: the simulation's modes must not see its item()
            value = values.item()
        return format(value, str(spec))

    def notes(self) -> list[str]:
        return []
