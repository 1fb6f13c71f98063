"""The user's torch.distributed world set aside while a simulated rank runs on a fake one of its own.

A pre-flight check in a training script runs after ``init_process_group``: ``estimate(parallelize=...)`` there
needs the process's default group for its fake ranks (``init_device_mesh`` and FSDP2 read the default group).
torch keeps its process groups in module state of ``torch.distributed.distributed_c10d`` (the ``_world`` object,
the maps of groups to names, ranks, backends and tags, the group counter) and in C++ (the global rank, and the
registry functional collectives resolve group names by). :func:`world_aside` stashes all of it, leaves an empty
world for the simulation to initialise and destroy, then puts the user's back exactly: the same objects, the
same global rank, every group registered again under its name (destroying the fake default group unregisters
every group). No collective runs on the user's groups, and none of them is destroyed.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["world_aside"]

# The module-level maps distributed_c10d's _World reads through properties, and its group counter.
_STATE = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag")


@contextlib.contextmanager
def world_aside() -> Iterator[None]:
    """Inside, torch.distributed is not initialised; after, the user's world is as it was (nothing is done when
    none was initialised)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        yield
        return
    from torch.distributed import distributed_c10d as c10d

    saved: dict[str, object] = {name: getattr(c10d, name) for name in (*_STATE, "_world", "_group_count")}
    default = c10d._world.default_pg
    try:
        for name in _STATE:
            setattr(c10d, name, {})
        c10d._group_count = 0
        c10d._world = c10d._World()
        c10d._update_default_pg(None)
        c10d._unregister_all_process_groups()  # the fake world names its groups "0", "1" ... as the job did
        yield
    finally:
        for name, value in saved.items():
            setattr(c10d, name, value)
        c10d._update_default_pg(default)
        c10d._unregister_all_process_groups()  # what the fake world left (its destruction unregisters it all)
        for pg, name in c10d._world.pg_names.items():
            c10d._register_process_group(name, pg)
