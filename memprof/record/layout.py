"""The parallel layout a rank ran under, as read from its parameters at profile time: the device mesh, which of
its dimensions shard which parameters, and FSDP2's policy. A rank's per-degree formula
(:mod:`memprof.analyse.reconciler.per_rank`) is built from this record, never from what a user types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .checks import corrupt, count, flag, mapping, optional_count, optional_text, seq, text

__all__ = ["MeshLayout", "ParamGroup"]


@dataclass(frozen=True)
class ParamGroup:
    """Parameters that the same mesh dimensions cut: ``sharded_by`` the dimensions whose placement is a shard
    (the parameter's global elements divide by the product of their sizes), ``replicated_over`` those it is
    whole on (sequence parallelism's norms on ``tp``, HSDP's replicas); ``elements`` their global element count,
    ``trainable`` those that require gradients, ``bytes`` their global bytes in the dtype they are stored in."""

    sharded_by: tuple[str, ...]
    replicated_over: tuple[str, ...]
    elements: int
    trainable: int
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"sharded_by": list(self.sharded_by), "replicated_over": list(self.replicated_over),
                "elements": self.elements, "trainable": self.trainable, "bytes": self.bytes}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParamGroup":
        data = mapping(data, "a parameter group")
        return cls(tuple(text(d, "a mesh dimension") for d in seq(data["sharded_by"], "sharded_by")),
                   tuple(text(d, "a mesh dimension") for d in seq(data["replicated_over"], "replicated_over")),
                   count(data["elements"], "a group's elements"), count(data["trainable"], "a group's trainable"),
                   count(data["bytes"], "a group's bytes"))


@dataclass(frozen=True)
class MeshLayout:
    """The rank's layout: the root device mesh of its DTensor parameters (``mesh``: (name, size) in mesh order;
    an unnamed dimension is named by its role, ``dp_shard`` for FSDP2's default mesh, ``dp_replicate`` and
    ``dp_shard`` for an unnamed HSDP mesh, ``tp`` for an unnamed one-dimensional mesh of tensor parallelism alone,
    else ``dim<i>``), the parameters grouped by the dimensions that cut them, and under FSDP2 the policy of its
    units: the dtype parameters are gathered in and gradients reduced in (``None``: the parameters' own), CPU
    offload, how many units there are and the bytes of the largest one gathered (every parameter of the unit,
    padded, in the gather's dtype)."""

    mesh: tuple[tuple[str, int], ...]
    groups: tuple[ParamGroup, ...]
    param_dtype: "str | None" = None
    reduce_dtype: "str | None" = None
    offload: bool = False
    units: "int | None" = None
    largest_unit_bytes: "int | None" = None

    def degree(self, name: str) -> int:
        """The size of the mesh dimension ``name`` (1 when the mesh has none)."""
        return next((s for n, s in self.mesh if n == name), 1)

    def to_dict(self) -> dict[str, Any]:
        return {"mesh": [[n, s] for n, s in self.mesh], "groups": [g.to_dict() for g in self.groups],
                "param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype, "offload": self.offload,
                "units": self.units, "largest_unit_bytes": self.largest_unit_bytes}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MeshLayout":
        data = mapping(data, "the mesh layout")
        dims = []
        for item in seq(data["mesh"], "the mesh"):
            name, size = seq(item, "a mesh dimension", 2)
            size = count(size, "a mesh dimension's size")
            if size < 1:
                raise corrupt(f"a mesh dimension's size must be at least 1, got {size}")
            dims.append((text(name, "a mesh dimension's name"), size))
        return cls(tuple(dims), tuple(ParamGroup.from_dict(g) for g in seq(data["groups"], "the parameter groups")),
                   optional_text(data.get("param_dtype"), "param_dtype"),
                   optional_text(data.get("reduce_dtype"), "reduce_dtype"), flag(data.get("offload", False), "offload"),
                   optional_count(data.get("units"), "units"),
                   optional_count(data.get("largest_unit_bytes"), "largest_unit_bytes"))
