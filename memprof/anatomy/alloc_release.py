"""How the caching-allocator model gives memory back: ``release_block``, ``release_available_cached_blocks``,
``release_cached_blocks`` (``empty_cache``) and ``garbage_collect_cached_blocks`` of
``c10/cuda/CUDACachingAllocator.cpp``.

The functions take the allocator as a :class:`ReleaseHost`: what they read and change of it.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Protocol

from .alloc_blocks import Block
from .alloc_events import synchronize_events
from .alloc_expandable import ExpandableHost, release_expandable, unmap_block

__all__ = ["ReleaseHost", "release_block", "release_available", "release_cached", "garbage_collect"]


class ReleaseHost(ExpandableHost, Protocol):
    """What the freeing part reads and changes of the allocator beyond an :class:`ExpandableHost`: the segment
    counters, and the memory fraction's ``allowed_memory_maximum`` the garbage collector's threshold is of."""

    segment_count: int
    oversize_segments: int
    awaiting: dict[int, Block]
    awaiting_bytes: int

    def _cache(self, block: Block) -> None: ...

    @property
    def allowed_memory_maximum(self) -> int | None: ...


def release_block(host: ReleaseHost, block: Block) -> None:
    """``release_block``: ``cudaFree`` of a whole free segment (already out of the free list)."""
    host.reserved -= block.size
    host.segment_count -= 1
    host.num_device_free += 1
    limit = host.config.max_split_size
    if limit is not None and block.size >= limit:
        host.oversize_segments -= 1


def release_available(host: ReleaseHost, small: bool, stream: int, size: int) -> bool:
    """``release_available_cached_blocks``: with a ``max_split_size``, free the smallest oversize block
    of the stream that covers the request, else oversize blocks from the largest down until enough."""
    limit = host.config.max_split_size
    if limit is None:
        return False
    free = host.pools.free.get((small, stream), [])
    target = max(size, limit)
    i = bisect_left(free, (target,))
    if i < len(free) and free[i][3].segment is None:
        release_block(host, free.pop(i)[3])
        return True
    released = 0
    i -= 1
    while i >= 0 and released < target and free[i][0] >= limit:
        block = free[i][3]
        if block.segment is None:
            del free[i]
            released += block.size
            release_block(host, block)
        i -= 1
    return released >= target


def release_cached(host: ReleaseHost) -> None:
    """``release_cached_blocks`` -> ``synchronize_and_free_events`` (the blocks awaiting other streams' events
    join the cache first, :mod:`.alloc_events`), then ``release_blocks`` of the large then the small pool: whole
    free segments are freed; expandable blocks are unmapped, and their segment freed once fully unmapped."""
    synchronize_events(host)
    pools = host.pools
    for small in (False, True):
        to_unmap = []
        for stream in pools.streams(small):
            free = pools.free[(small, stream)]
            kept = []
            for entry in free:
                block = entry[3]
                if block.segment is not None:
                    kept.append(entry)
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    release_block(host, block)
                else:
                    kept.append(entry)
            free[:] = kept
        for block in to_unmap:
            unmap_block(host, block)
            if not block.mapped and block.prev is None and block.next is None:
                release_expandable(host, block)


def garbage_collect(host: ReleaseHost) -> None:
    """``garbage_collect_cached_blocks``: above ``threshold * allowed memory``, free unsplit large
    blocks at least as old (in ``get_free_block`` calls) as the average, until the excess is freed."""
    allowed = host.allowed_memory_maximum
    if allowed is None:
        return  # the allocator collects only under a memory fraction
    threshold = int(host.config.garbage_collection_threshold * allowed)
    if host.reserved <= threshold:
        return
    target = host.reserved - threshold
    pools = host.pools
    clock = pools.gc_calls[False]
    unsplit = [b for b in pools.free_blocks(False) if not b.is_split]
    total_age, count = sum(clock - b.gc_base for b in unsplit), len(unsplit)
    reclaimed, freed = 0, True
    while reclaimed < target and freed and count > 0:
        average = total_age / count
        freed = False
        # Every block of the pass is freed once it is old enough, even past the target, so that the
        # collection does not run again at once.
        for block in pools.free_blocks(False):
            age = clock - block.gc_base
            if not block.is_split and block.segment is None and age >= average:
                freed = True
                reclaimed += block.size
                total_age -= age
                count -= 1
                pools.remove(block)
                release_block(host, block)
