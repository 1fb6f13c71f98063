"""What the caching-allocator model does when no cached block fits a request: the part of
``DeviceCachingAllocator::malloc`` after ``get_free_block`` fails (``c10/cuda/CUDACachingAllocator.cpp``):
garbage collection, a new segment (``alloc_block``: the memory fraction, ``throw_on_cudamalloc_oom``,
``cudaMalloc`` or the pages of an expandable segment), then the frees and retries torch tries before it raises
``OutOfMemoryError``.

The functions take the allocator as a :class:`SegmentHost`: what they read and change of it.
"""

from __future__ import annotations

from typing import Protocol

from ..errors import SimulatedOutOfMemoryError
from .alloc_blocks import Block
from .alloc_config import K_MIN_LARGE_ALLOC, K_ROUND_LARGE, K_SMALL_BUFFER, K_SMALL_SIZE
from .alloc_expandable import allocate_expandable, grow_reserved
from .alloc_release import ReleaseHost, garbage_collect, release_available, release_cached

__all__ = ["SegmentHost", "allocation_size", "new_block", "alloc_block", "out_of_memory"]


class SegmentHost(ReleaseHost, Protocol):
    """What the cache-miss part reads and changes of the allocator beyond a :class:`ReleaseHost`: the bytes
    allocated (for the error's message) and the counters of retries, rejections and out-of-memory errors."""

    @property
    def allocated(self) -> int: ...

    num_alloc_retries: int
    num_oom_rejections: int
    num_ooms: int
    peak_oversize_segments: int


def allocation_size(size: int, large_segment: int) -> int:
    """``get_allocation_size`` of a rounded ``size``: <= 1 MiB -> 2 MiB; < 10 MiB -> ``large_segment``;
    otherwise rounded up to 2 MiB."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def new_block(host: SegmentHost, small: bool, stream: int, size: int, nbytes: int) -> Block:
    """The part of ``malloc`` after a cache miss: garbage collection, a new segment, then the frees and
    retries torch tries before raising ``OutOfMemoryError`` (:class:`~memprof.errors.SimulatedOutOfMemoryError`)
    for the request of ``nbytes`` (``size`` rounded). The block comes out of no free list."""
    config = host.config
    alloc_size = allocation_size(size, config.large_segment_size)
    if host.allowed_memory_maximum is not None and config.garbage_collection_threshold > 0:
        garbage_collect(host)
    block, rejected = alloc_block(host, small, stream, size, alloc_size, retry=False)
    if block is None and not rejected:
        if release_available(host, small, stream, size):
            block, rejected = alloc_block(host, small, stream, size, alloc_size, retry=False)
        if block is None:
            release_cached(host)
            block, rejected = alloc_block(host, small, stream, size, alloc_size, retry=True)
    if block is None:
        raise out_of_memory(host, nbytes, alloc_size, rejected)
    return block


def alloc_block(host: SegmentHost, small: bool, stream: int, size: int, alloc_size: int,
                retry: bool) -> tuple[Block | None, bool]:
    """``alloc_block``: a new segment of ``alloc_size`` bytes (or pages of an expandable one), and whether
    ``throw_on_cudamalloc_oom`` rejected it (torch then raises at once, without freeing and retrying)."""
    if retry:
        host.num_alloc_retries += 1
    config = host.config
    allowed = host.allowed_memory_maximum
    if allowed is not None and host.reserved + alloc_size > allowed:
        return None, False
    if config.throw_on_cudamalloc_oom and host.device_total is not None:
        if host.reserved + alloc_size > int(config.per_process_memory_fraction * host.device_total):
            host.num_oom_rejections += 1
            return None, True
    if config.expandable_segments:
        return allocate_expandable(host, small, stream, size), False
    if host.capacity is not None and host.reserved + alloc_size > host.capacity:
        return None, False  # cudaMalloc fails
    addr, reg = host.space.take(-(-alloc_size // K_ROUND_LARGE) * K_ROUND_LARGE)
    block = Block(addr, alloc_size, stream, small, reg)
    host.segment_count += 1
    if config.max_split_size is not None and alloc_size >= config.max_split_size:
        host.oversize_segments += 1  # a Stat: increase_stat keeps its peak
        host.peak_oversize_segments = max(host.peak_oversize_segments, host.oversize_segments)
    grow_reserved(host, alloc_size)
    return block, False


def out_of_memory(host: SegmentHost, nbytes: int, alloc_size: int, rejected: bool) -> SimulatedOutOfMemoryError:
    """The error torch raises for the request of ``nbytes`` (counted in ``num_ooms`` unless
    ``throw_on_cudamalloc_oom`` rejected it), with the fix."""
    if not rejected:
        host.num_ooms += 1
    cached = host.reserved - host.allocated
    return SimulatedOutOfMemoryError(
        f"predicted CUDA out of memory: tried to allocate {alloc_size} B for a {nbytes} B request with "
        f"{host.allocated} B allocated and {cached} B reserved but unallocated, capacity "
        f"{host.capacity if host.capacity is not None else 'unlimited'} B"
        + (" (rejected by throw_on_cudamalloc_oom)" if rejected else "")
        + ". Fix: a smaller batch or sequence, activation checkpointing, a sharded optimizer"
        + ("; or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, since much reserved memory is unallocated"
           if cached > alloc_size and not host.config.expandable_segments else ""),
        requested=nbytes, allocated=host.allocated, reserved=host.reserved, capacity=host.capacity)
