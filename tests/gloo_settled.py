"""FSDP2's collectives on real gloo ranks, each let go by gloo before its caller goes on, as the simulation's fake
process group completes each at once.

gloo's worker thread drops its references to a collective's tensors a moment after the collective completes;
where the caller has dropped its own first, the storage is freed on that thread at a time the machine's load
decides (ProcessGroupGloo's worker resets its work in progress after marking it complete). A real rank's phase
may then end, or peak, holding a collective's buffer or not: full suite runs saw rank 0's backward peak differ in
gradients from its simulation, and its forward end hold an 8,840-byte gather buffer the simulation had freed;
each test passed alone. A worker calls :func:`settle_collectives` before it builds its model."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist


def _uses(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def let_go_by_gloo(collective: Callable[..., Any]) -> Callable[..., Any]:
    """``collective`` (an all-gather or reduce-scatter into one output) waited for, returning once gloo holds none
    of its tensors; an asynchronous call returns a finished stand-in for the work, which FSDP2 does not wait on (it
    waits only on a dist.Work)."""

    def call(output, input, *args, async_op=False, **kwargs):
        before = (_uses(output), _uses(input))
        work = collective(output, input, *args, async_op=True, **kwargs)
        work.wait()
        del work
        while (_uses(output), _uses(input)) != before:
            time.sleep(0)
        return object() if async_op else None

    return call


def settle_collectives() -> None:
    """FSDP2's all-gather and reduce-scatter, in this (spawned) process, settled as :func:`let_go_by_gloo` does."""
    dist.all_gather_single = let_go_by_gloo(dist.all_gather_single)
    dist.reduce_scatter_single = let_go_by_gloo(dist.reduce_scatter_single)
