"""Which rank of which parallel job a profile ran on: torch.distributed's view, read once at the start.

memprof launches and coordinates nothing: inside an initialised process group each process profiles
itself, and its trace says which rank it was, of how many, over which backend, and the parallel layout
the model is wrapped in (read from the model's own classes, so frameworks need not be imported).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from torch import nn

from ..errors import is_interrupt
from ..record.parts import RankInfo
from ..units import round_half_away
from .mesh_layout import cuts, is_fsdp2_module, mesh_layout

__all__ = ["rank_info", "is_fsdp2_module", "shards_of"]


def rank_info(model: nn.Module) -> "RankInfo | None":
    """The rank this process is in an initialised default process group, or None outside one."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
    except Exception as failure:  # a process group memprof cannot read: say nothing rather than guess
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return None
    layout = _layout(model)
    view = None
    if layout == "ddp":
        ddp = next((m for m in model.modules() if type(m).__name__ == "DistributedDataParallel"), None)
        view = bool(getattr(ddp, "gradient_as_bucket_view", False)) if ddp is not None else None
    shares = _shares(model)
    if shares is not None and layout is None:
        layout = "tp"  # DTensor parameters without a data-parallel wrapper: tensor (or sequence) parallelism
    info = RankInfo(rank=rank, world_size=world, backend=backend, layout=layout, bucket_view=view)
    if shares is not None:
        info = dataclasses.replace(info, params_per_rank=shares[0], trainable_per_rank=shares[1], shards=shares[2],
                                   layout_detail=mesh_layout(model, layout))
    return info


def _shares(model: nn.Module) -> "tuple[int, int, int | None] | None":
    """This rank's share of the model's parameters and of the trainable ones, in elements (half up), and the
    shard count every parameter shares (None if they differ), when some are DTensors; None otherwise."""
    total = trainable = Fraction(0)
    found = False
    counts: set[int] = set()
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = shards_of(p)
        counts.add(n)
        share = Fraction(p.numel(), n)
        found = found or hasattr(p, "placements")
        total += share
        if p.requires_grad:
            trainable += share
    if not found:
        return None
    return round_half_away(total), round_half_away(trainable), counts.pop() if len(counts) == 1 else None


def shards_of(p: object) -> int:
    """Into how many pieces a DTensor's placements cut it (1 for a plain tensor, or a replicated one)."""
    placements = getattr(p, "placements", None)
    if placements is None:
        return 1
    n = 1
    try:
        mesh = p.device_mesh  # type: ignore[attr-defined]  # a DTensor's (it has placements), which object lacks
        for dim, placement in enumerate(placements):
            if cuts(placement):
                n *= mesh.size(dim)
    except Exception as failure:  # a DTensor memprof cannot read: counted whole
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return 1
    return n


def _layout(model: nn.Module) -> "str | None":
    """The data-parallel wrapping of ``model``: ``ddp``, ``fsdp2`` (``fully_shard``), ``fsdp1`` or
    ``deepspeed``; None when there is none."""
    names: set[str] = set()
    for m in model.modules():
        for klass in type(m).__mro__:
            names.add(f"{klass.__module__}.{klass.__qualname__}")
    if any(n.endswith(".DistributedDataParallel") for n in names):
        return "ddp"
    if any(is_fsdp2_module(m) for m in model.modules()):
        return "fsdp2"
    if any(n.endswith(".FullyShardedDataParallel") for n in names):
        return "fsdp1"
    if any(n.startswith("deepspeed.") for n in names):
        return "deepspeed"
    return None
