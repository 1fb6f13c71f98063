"""``expandable_segments:True`` in the caching-allocator model (Note [Expandable Segments] and
``struct ExpandableSegment`` in ``c10/cuda/CUDACachingAllocator.cpp``).

One virtual segment per (stream, pool) reserves address space for 9/8 of the device's memory and maps
physical pages on demand: 2 MiB pages (``kSmallBuffer``) for the small pool, ``large_segment_size``
(20 MiB) pages for the large pool. Reserved memory is the mapped pages; ``empty_cache`` unmaps every page
that lies wholly inside a free block and gives back a segment once nothing in it is mapped.

The functions take the allocator as an :class:`ExpandableHost`: what they read and change of it.
"""

from __future__ import annotations

from typing import Protocol, TypeGuard

from .alloc_blocks import AddressSpace, Block, BlockPools, ExpandableSegment
from .alloc_config import K_SMALL_BUFFER, AllocatorConfig

__all__ = ["ExpandableHost", "ExpandableSegment", "grow_reserved", "find_expandable", "map_block",
           "allocate_expandable", "unmap_block", "release_expandable"]

# With no device size given, the model reserves the 256 TiB of address space the Note speaks of.
_UNBOUNDED_VA = 1 << 48


class ExpandableHost(Protocol):
    """What the parts that take and give back device memory read and change of the allocator
    (:class:`~memprof.anatomy.allocator.CachingAllocator`): its settings, its blocks and address space, and the
    counters of reserved memory."""

    @property
    def config(self) -> AllocatorConfig: ...
    @property
    def capacity(self) -> int | None: ...
    @property
    def device_total(self) -> int | None: ...
    @property
    def pools(self) -> BlockPools: ...
    @property
    def space(self) -> AddressSpace: ...

    reserved: int
    peak_reserved: int
    num_device_alloc: int
    num_device_free: int


def grow_reserved(host: ExpandableHost, nbytes: int) -> None:
    """A device allocation (``cudaMalloc`` or mapped pages): reserved grows by ``nbytes``."""
    host.reserved += nbytes
    host.num_device_alloc += 1
    if host.reserved > host.peak_reserved:
        host.peak_reserved = host.reserved


def find_expandable(host: ExpandableHost, small: bool, stream: int, size: int) -> Block | None:
    """``find_expandable_block``: the lowest address where free and unmapped blocks together hold
    ``size`` bytes (starting at a free block right before an unmapped one), else a new segment;
    ``None`` when even a new segment is smaller than ``size``."""
    def allocatable(b: Block | None) -> TypeGuard[Block]:
        return b is not None and not b.allocated

    pools = host.pools
    for _, block in pools.unmapped.get((small, stream), ()):
        start = block.prev if allocatable(block.prev) else block
        room = 0
        b: Block | None = start
        while room < size and allocatable(b):
            room += b.size
            b = b.next
        if room >= size:
            return start
    page = K_SMALL_BUFFER if small else host.config.large_segment_size
    # ExpandableSegment's constructor reserves totalGlobalMem + totalGlobalMem / 8, in whole pages.
    total = host.device_total
    reserve = _UNBOUNDED_VA if total is None else total + total // 8
    pages = -(-reserve // page)
    if page * pages < size:
        return None  # a single allocation cannot span expandable segments
    base, reg = host.space.take(page * pages)
    segment = ExpandableSegment(base, page, pages, stream, small)
    candidate = Block(segment.base, segment.size, stream, small, reg, segment, mapped=False)
    pools.insert_unmapped(candidate)
    return candidate


def _segment(block: Block) -> ExpandableSegment:
    segment = block.segment
    if segment is None:
        raise AssertionError(f"{block} is no block of an expandable segment")  # a defect of the model
    return segment


def map_block(host: ExpandableHost, block: Block, size: int) -> bool:
    """``map_block``: back the first ``size`` bytes of the unmapped ``block`` with whole pages; the rest
    stays unmapped. False when the device has no room for the pages (``cuMemCreate`` fails)."""
    segment = _segment(block)
    begin = (block.addr - segment.base) // segment.page
    end = -(-(block.addr + size - segment.base) // segment.page)
    mapped = (end - begin) * segment.page
    if host.capacity is not None and host.reserved + mapped > host.capacity:
        return False
    pools = host.pools
    pools.remove_unmapped(block)
    block.mapped = True
    if mapped < block.size:
        rest = Block(block.addr + mapped, block.size - mapped, block.stream, block.small, block.reg, segment,
                     mapped=False)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        pools.insert_unmapped(rest)
        block.size = mapped
    pools.merge(block, block.prev)
    pools.merge(block, block.next)
    pools.insert(block)
    segment.mapped += mapped
    grow_reserved(host, mapped)
    return True


def allocate_expandable(host: ExpandableHost, small: bool, stream: int, size: int) -> Block | None:
    """``try_allocate_expandable_block``: map pages until one free block of ``size`` bytes exists;
    it comes back out of the free list."""
    candidate = find_expandable(host, small, stream, size)
    if candidate is None:
        return None
    if not candidate.mapped and not map_block(host, candidate, min(candidate.size, size)):
        return None
    while candidate.size < size:
        following = candidate.next  # free -> unmapped: mapping it merges the two
        if following is None:
            raise AssertionError(f"{candidate} ends its segment short of {size} B")  # find_expandable found room
        if not map_block(host, following, min(size - candidate.size, following.size)):
            return None
        candidate = following
    host.pools.remove(candidate)
    return candidate


def unmap_block(host: ExpandableHost, block: Block) -> None:
    """``unmap_block``: give back the pages wholly inside the free ``block``; the partial pages at
    either end stay mapped as free blocks of their own."""
    segment = _segment(block)
    begin = -(-(block.addr - segment.base) // segment.page)
    end = (block.addr + block.size - segment.base) // segment.page
    if begin >= end:
        return
    pools = host.pools
    pools.remove(block)
    start = segment.base + begin * segment.page
    unmapped = (end - begin) * segment.page
    before = start - block.addr
    after = block.size - before - unmapped
    if before > 0:
        head = Block(block.addr, before, block.stream, block.small, block.reg, segment)
        head.prev, head.next = block.prev, block
        if block.prev is not None:
            block.prev.next = head
        block.prev = head
        pools.insert(head)
    if after > 0:
        tail = Block(start + unmapped, after, block.stream, block.small, block.reg, segment)
        tail.prev, tail.next = block, block.next
        if block.next is not None:
            block.next.prev = tail
        block.next = tail
        pools.insert(tail)
    block.addr, block.size, block.mapped = start, unmapped, False
    pools.merge(block, block.prev)
    pools.merge(block, block.next)
    pools.insert_unmapped(block)
    segment.mapped -= unmapped
    host.reserved -= unmapped
    host.num_device_free += 1


def release_expandable(host: ExpandableHost, block: Block) -> None:
    """``release_expandable_segment``: a segment with nothing mapped gives back its address range."""
    host.pools.remove_unmapped(block)
