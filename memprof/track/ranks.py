"""Which rank of which parallel job a profile ran on: torch.distributed's view, read once at the start.

memprof launches and coordinates nothing: inside an initialised process group each process profiles
itself, and its trace says which rank it was, of how many, over which backend, and the parallel layout
the model is wrapped in (read from the model's own classes, so frameworks need not be imported).
"""

from __future__ import annotations


from torch import nn

from ..records import RankInfo

__all__ = ["rank_info"]


def rank_info(model: nn.Module) -> "RankInfo | None":
    """The rank this process is in an initialised default process group, or None outside one."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
    except Exception:  # a process group memprof cannot read: say nothing rather than guess
        return None
    layout = _layout(model)
    view = None
    if layout == "ddp":
        ddp = next((m for m in model.modules() if type(m).__name__ == "DistributedDataParallel"), None)
        view = bool(getattr(ddp, "gradient_as_bucket_view", False)) if ddp is not None else None
    return RankInfo(rank=rank, world_size=world, backend=backend, layout=layout, bucket_view=view)


def _layout(model: nn.Module) -> "str | None":
    """The data-parallel wrapping of ``model``: ``ddp``, ``fsdp2`` (``fully_shard``), ``fsdp1`` or
    ``deepspeed``; None when there is none."""
    names: set[str] = set()
    for m in model.modules():
        for klass in type(m).__mro__:
            names.add(f"{klass.__module__}.{klass.__qualname__}")
    if any(n.endswith(".DistributedDataParallel") for n in names):
        return "ddp"
    if any(n.startswith("torch.distributed.fsdp") and n.rsplit(".", 1)[-1] == "FSDPModule" for n in names):
        return "fsdp2"
    if any(n.endswith(".FullyShardedDataParallel") for n in names):
        return "fsdp1"
    if any(n.startswith("deepspeed.") for n in names):
        return "deepspeed"
    return None
