"""Blocks freed while another stream still uses them: ``record_stream`` in torch's caching allocator.

``Tensor.record_stream(s)`` marks a block as used on stream ``s`` besides its own. When such a block is freed,
``DeviceCachingAllocator::free`` takes its bytes out of the allocated statistics at once, but ``insert_events``
records an event on each stream that used it and the block stays out of the free lists, and out of its
neighbours' merges (``try_merge_blocks`` skips a block with events), until ``process_events`` sees every event
complete at a later ``malloc``; ``release_cached_blocks`` (``empty_cache``, and the retry after a failed
``cudaMalloc``) first waits for every outstanding event (``synchronize_and_free_events``)
(c10/cuda/CUDACachingAllocator.cpp). Which event completes when is the device's timing, which a replay decides
(:func:`memprof.simulate.alloc_stream.replay_stream`); these functions are the allocator's side of it.
"""

from __future__ import annotations

from typing import Protocol

from ..errors import InvalidArgumentError
from .alloc_blocks import Block

__all__ = ["EventHost", "await_events", "release_awaiting", "synchronize_events"]


class EventHost(Protocol):
    """What the functions here read and change of the allocator."""

    awaiting: dict[int, Block]
    awaiting_bytes: int

    def _cache(self, block: Block) -> None: ...


def await_events(host: EventHost, handle: int, block: Block) -> None:
    """``insert_events``: the freed ``block`` waits for the other streams' events, out of the cache."""
    host.awaiting[handle] = block
    host.awaiting_bytes += block.size


def release_awaiting(host: EventHost, handle: int) -> None:
    """``process_events`` for one block: its events completed, it joins the cache (``free_block``)."""
    block = host.awaiting.pop(handle, None)
    if block is None:
        raise InvalidArgumentError(f"handle {handle!r} is not awaiting events (never freed with awaiting=True, or "
                                   "released already)")
    host.awaiting_bytes -= block.size
    host._cache(block)


def synchronize_events(host: EventHost) -> None:
    """``synchronize_and_free_events``: every outstanding event waited for, every awaiting block cached."""
    for handle in list(host.awaiting):
        release_awaiting(host, handle)
