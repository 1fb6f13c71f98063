"""The parallel layout a rank ran under, as read from its parameters at profile time: the device mesh, which of
its dimensions shard which parameters, and FSDP2's policy. A rank's per-degree formula
(:mod:`memprof.analyse.reconciler.per_rank`) is built from this record, never from what a user types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import fields as fileform
from .checks import corrupt
from .aliases import JSONObject
from .fields import form

__all__ = ["MeshLayout", "ParamGroup"]


@dataclass(frozen=True)
class ParamGroup:
    """Parameters that the same mesh dimensions cut: ``sharded_by`` the dimensions whose placement is a shard
    (the parameter's global elements divide by the product of their sizes), ``replicated_over`` those it is
    whole on (sequence parallelism's norms on ``tp``, HSDP's replicas); ``elements`` their global element count,
    ``trainable`` those that require gradients, ``bytes`` their global bytes in the dtype they are stored in."""

    sharded_by: tuple[str, ...] = field(metadata=form(label="sharded_by"))
    replicated_over: tuple[str, ...] = field(metadata=form(label="replicated_over"))
    elements: int = field(metadata=form(label="a group's elements"))
    trainable: int = field(metadata=form(label="a group's trainable"))
    bytes: int = field(metadata=form(label="a group's bytes"))

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "ParamGroup":
        return fileform.read(cls, data, "a parameter group")


@dataclass(frozen=True)
class MeshLayout:
    """The rank's layout: the root device mesh of its DTensor parameters (``mesh``: (name, size) in mesh order;
    an unnamed dimension is named by its role, ``dp_shard`` for FSDP2's default mesh, ``dp_replicate`` and
    ``dp_shard`` for an unnamed HSDP mesh, ``tp`` for an unnamed one-dimensional mesh of tensor parallelism alone,
    else ``dim<i>``), the parameters grouped by the dimensions that cut them, and under FSDP2 the policy of its
    units: the dtype parameters are gathered in and gradients reduced in (``None``: the parameters' own), CPU
    offload, how many units there are and the bytes of the largest one gathered (every parameter of the unit,
    padded, in the gather's dtype)."""

    mesh: tuple[tuple[str, int], ...] = field(metadata=form(label="a mesh dimension"))
    groups: tuple[ParamGroup, ...] = field(metadata=form(label="the parameter groups"))
    param_dtype: "str | None" = field(default=None, metadata=form(label="param_dtype"))
    reduce_dtype: "str | None" = field(default=None, metadata=form(label="reduce_dtype"))
    offload: bool = field(default=False, metadata=form(label="offload"))
    units: "int | None" = field(default=None, metadata=form(label="units"))
    largest_unit_bytes: "int | None" = field(default=None, metadata=form(label="largest_unit_bytes"))

    def degree(self, name: str) -> int:
        """The size of the mesh dimension ``name`` (1 when the mesh has none)."""
        return next((s for n, s in self.mesh if n == name), 1)

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "MeshLayout":
        """Read from a file: every mesh dimension at least 1 in size."""
        layout = fileform.read(cls, data, "the mesh layout")
        for _, size in layout.mesh:
            if size < 1:
                raise corrupt(f"a mesh dimension's size must be at least 1, got {size}")
        return layout
