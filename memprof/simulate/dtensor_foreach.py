"""A pointwise ``torch._foreach_*`` op over DTensor lists run on their local shards, as DTensor runs it, without its
per-call sharding propagation.

An optimizer's foreach step over an FSDP2 or TP rank's parameters calls a dozen ``torch._foreach_*`` ops a step,
each on lists of DTensors. DTensor answers each from its sharding propagation, whose cache is keyed by every
element's metadata: a list of another length (each cut of a deep model's stack: :mod:`memprof.simulate.depth`) or
another first step misses it, and the propagation of a foreach op works out a strategy per element (torch's
``single_dim_strategy.expanded_foreach_strategy``): 0.54 s of a 3.8 s pipeline stage estimate went to AdamW's step.
Where every element's DTensors share one spec with no ``Partial`` placement, a pointwise op's strategy is that spec
for the inputs and the outputs, nothing is redistributed, and the local op is the one DTensor runs on the local
shards (``torch/distributed/tensor/_dispatch.py``: ``OpDispatcher`` runs ``op_call`` on the local tensors and wraps
the outputs in the output spec); the same allocations, in the same order. Only an overload DTensor registers a
strategy for is taken (its registries read, the overload resolved from the arguments as the dispatcher resolves it):
one it refuses (``_foreach_maximum.Scalar``) must fail as a real run fails. Anything else (a reduction such as
``_foreach_norm``, a lone tensor argument, lists laid out apart, a shard order other than the default, an
out-of-place op over strided globals, whose output strides DTensor works out afresh) goes to DTensor as before.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..errors import is_interrupt
from .modes import Next, Rule

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    from .aliases import OpValue

__all__ = ["DTensorForeach", "POINTWISE"]

#: The foreach ops whose outputs are shaped and placed as their first list's elements: pointwise in every list
#: argument (torch's DTensor gives them its pointwise strategy, ``torch/distributed/tensor/_ops/_pointwise_ops.py``).
#: Each also in place (a trailing ``_``); which of their overloads DTensor takes is read from DTensor
#: (:func:`_registered`).
POINTWISE = frozenset(
    f"_foreach_{name}{suffix}" for suffix in ("", "_") for name in (
        "abs", "add", "addcdiv", "addcmul", "clamp_max", "clamp_min", "div", "exp", "lerp", "maximum", "minimum",
        "mul", "neg", "pow", "reciprocal", "sigmoid", "sign", "sqrt", "sub", "zero"))

#: Per (op name, overload name): does DTensor register a sharding strategy for it?
_REGISTERED: dict[tuple[str, str], bool] = {}


def _registered(name: str, args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]") -> bool:
    """Is the overload of ``aten::name`` these arguments call one DTensor has a sharding strategy for? The overload
    is resolved as the dispatcher resolves it (``torch._C._jit_resolve_packet``); one that resolves to none, or a
    torch whose DTensor keeps its registries elsewhere, is left to DTensor."""
    try:
        overload = torch._C._jit_resolve_packet(f"aten::{name}", *args, **kwargs)
    except Exception as exc:  # no overload takes these arguments: DTensor's own call raises what torch raises
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return False
    known = _REGISTERED.get((name, overload))
    if known is None:
        from torch.distributed.tensor import DTensor

        op = getattr(getattr(torch.ops.aten, name), overload)
        propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
        known = _REGISTERED[(name, overload)] = any(
            op in getattr(propagator, registry, {})
            for registry in ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules"))
    return known


def _spec_of(args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]") -> "list[DTensorSpec] | None":
    """Element i's spec (its first list's), for every element of the list arguments, when every list is of
    DTensors, the lists are of one length, each element's DTensors lie alike (:func:`_alike`; their dtypes may
    differ, as the local op promotes them as DTensor's does), none ``Partial`` or in a shard order other than the
    default (DTensor redistributes those), and no other argument is a tensor; else None."""
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
            if not all(_plain(s) for s in now):
                return None
            specs = now
        elif len(now) != len(specs) or not all(_alike(a, b) for a, b in zip(now, specs)):
            return None
    return specs


def _plain(spec: "DTensorSpec") -> bool:
    """A spec with its metadata, no ``Partial`` placement, and the default shard order (or one its
    ``_StridedShard`` placements say, as FSDP2 over TP lays parameters out)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return (spec.tensor_meta is not None and not any(p.is_partial() for p in spec.placements)
            and (spec.use_strided_shard_as_shard_order or DTensorSpec.is_default_device_order(spec.shard_order)))


def _alike(a: "DTensorSpec", b: "DTensorSpec") -> bool:
    """One mesh, placements, shard order, global shape and stride."""
    return (a.tensor_meta is not None and b.tensor_meta is not None and a.mesh == b.mesh
            and a.placements == b.placements and a.shard_order == b.shard_order
            and a.use_strided_shard_as_shard_order == b.use_strided_shard_as_shard_order
            and a.tensor_meta.shape == b.tensor_meta.shape and a.tensor_meta.stride == b.tensor_meta.stride)


def _contiguous(spec: "DTensorSpec") -> bool:
    meta = spec.tensor_meta
    assert meta is not None  # _spec_of took only specs with their metadata
    return tuple(meta.stride) == torch._prims_common.make_contiguous_strides_for(meta.shape)


def _needs_grad(args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]") -> bool:
    return any(isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in v)
               for v in (*args, *kwargs.values()))


def _local(value: "OpValue") -> "OpValue":
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return [t._local_tensor for t in value]  # DTensors: checked by _spec_of
    return value


class DTensorForeach(Rule):
    """The rule: a :data:`POINTWISE` foreach op whose list arguments :func:`_spec_of` accepts, in an overload
    DTensor takes (:func:`_registered`), runs on the local shards, its outputs (out of place, over contiguous
    globals) wrapped in their element's spec."""

    def handle(self, func: "Callable[..., OpValue]", args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]",
               next: Next) -> OpValue:
        name = getattr(func, "__name__", None)
        if name not in POINTWISE:
            return next(func, args, kwargs)
        in_place = name.endswith("_")
        specs = _spec_of(args, kwargs)
        if (specs is None or (not in_place and not all(_contiguous(s) for s in specs))
                or (torch.is_grad_enabled() and _needs_grad(args, kwargs))  # DTensor's autograd graph
                or not _registered(name, args, kwargs)):
            return next(func, args, kwargs)
        out = next(func, tuple(_local(a) for a in args), {k: _local(v) for k, v in kwargs.items()})
        if in_place:
            # The local shards changed and their DTensors hold them; torch hands back the list it changed (its
            # ``self``), the DTensors, as DTensor's own dispatch does.
            return args[0] if args else kwargs.get("self", out)
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import TensorMeta

        wrapped = []
        for local, spec in zip(out, specs):
            meta = spec.tensor_meta
            assert meta is not None  # _spec_of took only specs with their metadata
            if meta.dtype != local.dtype:  # promoted (a bf16 list with an fp32 one), as DTensor's output spec is
                spec = dataclasses.replace(spec, tensor_meta=TensorMeta(meta.shape, meta.stride, local.dtype))
            wrapped.append(DTensor(local, spec, requires_grad=False))  # type: ignore[no-untyped-call]
        return wrapped
