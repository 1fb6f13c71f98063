"""The parallel layout of a rank, read from its parameters when the profile starts: the DTensors' device mesh
(the root mesh, so a pipeline dimension the stage's parameters do not live on is seen too), which dimensions cut
which parameters, and FSDP2's units and policy (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``:
``mp_policy``, ``offload_policy``, ``fsdp_params``). Nothing is typed by the user; what memprof cannot read is
left out (``None``), never guessed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import is_interrupt
from ..record.layout import MeshLayout, ParamGroup

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["mesh_layout", "is_fsdp2_module", "cuts"]


def cuts(placement: "Placement") -> bool:
    """Does a DTensor placement cut the tensor along its mesh dimension? ``Shard``, and ``_StridedShard``, which
    FSDP2 puts on its dimension over a tensor-parallel shard of the same tensor dimension and whose
    ``is_shard()`` is False (``torch/distributed/tensor/placement_types.py``, ``_is_shard_like``)."""
    return bool(placement.is_shard()) or type(placement).__name__ == "_StridedShard"


def is_fsdp2_module(m: nn.Module) -> bool:
    """Did ``fully_shard`` make ``m`` an ``FSDPModule`` (read from its classes, without importing FSDP)?"""
    return any(k.__name__ == "FSDPModule" and k.__module__.startswith("torch.distributed.fsdp")
               for k in type(m).__mro__)


def mesh_layout(model: nn.Module, layout: "str | None") -> "MeshLayout | None":
    """``model``'s layout, or None when none of its parameters is a DTensor (or their meshes cannot be read)."""
    groups: dict[tuple[tuple[str, ...], tuple[str, ...]], list[int]] = {}
    root: "DeviceMesh | None" = None
    seen: set[int] = set()
    try:
        for p in model.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            placements = getattr(p, "placements", None)
            if placements is None:
                key: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
            else:
                # A DTensor (it has placements), which nn.Parameter's type does not say.
                mesh = p.device_mesh  # type: ignore[attr-defined]
                root = root if root is not None else _root(mesh)
                names = _names(mesh, layout)
                key = (tuple(n for n, pl in zip(names, placements) if cuts(pl)),
                       tuple(n for n, pl in zip(names, placements) if not cuts(pl)))
            acc = groups.setdefault(key, [0, 0, 0])
            acc[0] += p.numel()
            acc[1] += p.numel() if p.requires_grad else 0
            acc[2] += p.numel() * p.element_size()
    except Exception as failure:  # a DTensor or mesh memprof cannot read: no layout rather than a wrong one
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return None
    if root is None:
        return None
    mesh_dims = tuple(zip(_names(root, layout), (int(s) for s in root.mesh.shape)))
    out = MeshLayout(mesh_dims, tuple(ParamGroup(k[0], k[1], *v) for k, v in sorted(groups.items())))
    return _fsdp_policy(model, out) if layout == "fsdp2" else out


def _root(mesh: "DeviceMesh") -> "DeviceMesh":
    get = getattr(mesh, "_get_root_mesh", None)
    try:
        root: "DeviceMesh" = get() if get is not None else mesh
        return root
    except Exception as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return mesh


def _names(mesh: "DeviceMesh", layout: "str | None") -> tuple[str, ...]:
    """The mesh's dimension names; an unnamed one by its role (FSDP2 builds unnamed meshes of its own, and a
    one-dimensional mesh under parameters no data-parallel wrapper holds is tensor parallelism's)."""
    names = getattr(mesh, "mesh_dim_names", None)
    if names:
        return tuple(names)
    if layout == "fsdp2" and mesh.ndim == 1:
        return ("dp_shard",)
    if layout == "fsdp2" and mesh.ndim == 2:  # HSDP: replicate over the first dimension, shard over the second
        return ("dp_replicate", "dp_shard")
    if layout == "tp" and mesh.ndim == 1:  # DTensor parameters and no data-parallel wrapper: tensor parallelism
        return ("tp",)
    return tuple(f"dim{i}" for i in range(mesh.ndim))


def _fsdp_policy(model: nn.Module, layout: MeshLayout) -> MeshLayout:
    """FSDP2's policy and units: the dtypes of its ``MixedPrecisionPolicy``, whether it offloads, and the bytes of
    its largest unit gathered (each parameter's padded shard times the shard dimension's size, in the gather's
    dtype: ``param_dtype`` or the parameter's own)."""
    import dataclasses

    param_dtypes: set[str] = set()
    reduce_dtypes: set[str] = set()
    offload = False
    units = 0
    largest = 0
    try:
        for m in model.modules():
            if not is_fsdp2_module(m):
                continue
            # An FSDP2 module's (is_fsdp2_module), which nn.Module's type lacks.
            group = m._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
            if group is None:
                continue
            units += 1
            mp = group.mp_policy
            param_dtypes.add(_dtype(mp.param_dtype))
            reduce_dtypes.add(_dtype(mp.reduce_dtype))
            offload = offload or type(group.offload_policy).__name__ == "CPUOffloadPolicy"
            unit = 0
            for fp in group.fsdp_params:
                dtype = mp.param_dtype or fp.sharded_param.dtype
                item = torch.empty((), dtype=dtype).element_size()
                unit += math.prod(fp.padded_sharded_param_size) * fp.mesh_info.shard_mesh_size * item
            largest = max(largest, unit)
    except Exception as failure:  # FSDP2's internals not as this memprof knows them: the policy is left out
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return layout
    return dataclasses.replace(layout, param_dtype=_one(param_dtypes), reduce_dtype=_one(reduce_dtypes),
                               offload=offload, units=units or None, largest_unit_bytes=largest or None)


def _one(dtypes: set[str]) -> "str | None":
    """The units' dtype when they share one; None for the parameters' own, or units that differ."""
    return next(iter(dtypes)) or None if len(dtypes) == 1 else None


def _dtype(d: "torch.dtype | None") -> str:
    return "" if d is None else str(d).replace("torch.", "")
