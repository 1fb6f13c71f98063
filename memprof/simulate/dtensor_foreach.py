"""A pointwise ``torch._foreach_*`` op over DTensor lists run on their local shards, as DTensor runs it, without
its per-call sharding propagation.

An optimizer's foreach step over an FSDP2 or TP rank's parameters calls a dozen ``torch._foreach_*`` ops a step,
each on lists of DTensors. DTensor answers each from its sharding propagation, whose cache is keyed by every
element's metadata: a list of another length (each cut of a deep model's stack: :mod:`memprof.simulate.depth`) or
another first step misses it, and the propagation of a foreach op works out a strategy per element (torch's
``single_dim_strategy.expanded_foreach_strategy``), which took a fifth of a pipeline stage's simulation. Where every
element's DTensors share one spec with no ``Partial`` placement, a pointwise op's strategy is that spec for the
inputs and the outputs, nothing is redistributed, and the local op is the one DTensor runs on the local shards
(``torch/distributed/tensor/_dispatch.py``: ``OpDispatcher`` runs ``op_call`` on the local tensors and wraps the
outputs in the output spec); the same allocations, in the same order. Anything else (a reduction such as
``_foreach_norm``, a lone tensor argument, mixed specs) goes to DTensor as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .modes import Next, Rule

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    from .aliases import OpValue

__all__ = ["DTensorForeach", "POINTWISE"]

#: The foreach ops whose outputs are shaped and placed as their first list's elements: pointwise in every list
#: argument (torch's DTensor gives them its pointwise strategy, ``torch/distributed/tensor/_ops/_pointwise_ops.py``).
#: Each also in place (a trailing ``_``).
POINTWISE = frozenset(
    f"_foreach_{name}{suffix}" for suffix in ("", "_") for name in (
        "abs", "add", "addcdiv", "addcmul", "clamp_max", "clamp_min", "div", "exp", "lerp", "maximum", "minimum",
        "mul", "neg", "pow", "reciprocal", "sigmoid", "sign", "sqrt", "sub", "zero"))


def _spec_of(args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]") -> "list[DTensorSpec] | None":
    """Element i's spec (its first list's), for every element of the list arguments, when every list is of
    DTensors, the lists are of one length, each element's DTensors lie alike (one mesh, one set of placements, none
    ``Partial``, one global shape and stride; their dtypes may differ, as the local op promotes them as DTensor's
    does) and no other argument is a tensor; else None."""
    from torch.distributed.tensor import DTensor

    specs: "list[DTensorSpec] | None" = None
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return None
        if not isinstance(value, (list, tuple)) or not value or not isinstance(value[0], torch.Tensor):
            continue
        if not all(type(t) is DTensor for t in value):
            return None
        now = [t._spec for t in value]  # DTensor's
        if specs is None:
            if any(s.tensor_meta is None or any(p.is_partial() for p in s.placements) for s in now):
                return None
            specs = now
        elif len(now) != len(specs) or not all(_alike(a, b) for a, b in zip(now, specs)):
            return None
    return specs


def _alike(a: "DTensorSpec", b: "DTensorSpec") -> bool:
    return (a.tensor_meta is not None and b.tensor_meta is not None and a.mesh == b.mesh
            and a.placements == b.placements and a.tensor_meta.shape == b.tensor_meta.shape
            and a.tensor_meta.stride == b.tensor_meta.stride)


def _needs_grad(args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]") -> bool:
    return any(isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in v)
               for v in (*args, *kwargs.values()))


def _local(value: "OpValue") -> "OpValue":
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return [t._local_tensor for t in value]  # DTensors: checked by _spec_of
    return value


class DTensorForeach(Rule):
    """The rule: a :data:`POINTWISE` foreach op whose list arguments :func:`_spec_of` accepts runs on the local
    shards, its outputs (out of place) wrapped in their element's spec."""

    def handle(self, func: "Callable[..., OpValue]", args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]",
               next: Next) -> OpValue:
        if getattr(func, "__name__", None) not in POINTWISE:
            return next(func, args, kwargs)
        specs = _spec_of(args, kwargs)
        if specs is None or (torch.is_grad_enabled() and _needs_grad(args, kwargs)):  # DTensor's autograd graph
            return next(func, args, kwargs)
        out = next(func, tuple(_local(a) for a in args), {k: _local(v) for k, v in kwargs.items()})
        if func.__name__.endswith("_"):
            # In place: the local shards changed and their DTensors hold them; torch hands back the list it changed
            # (its first argument), the DTensors as DTensor's own dispatch does.
            return args[0] if args else out
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        wrapped = []
        for local, spec in zip(out, specs):
            meta = spec.tensor_meta
            assert meta is not None  # _spec_of took only specs with their metadata
            if meta.dtype != local.dtype:  # promoted (a bf16 list with an fp32 one), as DTensor's output spec is
                spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride,
                                                                                       local.dtype))
            wrapped.append(DTensor(local, spec, requires_grad=False))  # type: ignore[no-untyped-call]
        return wrapped
