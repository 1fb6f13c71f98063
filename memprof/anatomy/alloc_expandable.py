"""``expandable_segments:True`` in the caching-allocator model (Note [Expandable Segments] and
``struct ExpandableSegment`` in ``c10/cuda/CUDACachingAllocator.cpp``).

One virtual segment per (stream, pool) reserves address space for 9/8 of the device's memory and maps
physical pages on demand: 2 MiB pages (``kSmallBuffer``) for the small pool, ``large_segment_size``
(20 MiB) pages for the large pool. Reserved memory is the mapped pages; ``empty_cache`` unmaps every page
that lies wholly inside a free block and gives back a segment once nothing in it is mapped.
"""

from __future__ import annotations

from .alloc_blocks import Block, ExpandableSegment
from .alloc_config import K_SMALL_BUFFER

__all__ = ["ExpandableSegment", "ExpandableMixin"]

# With no device size given, the model reserves the 256 TiB of address space the Note speaks of.
_UNBOUNDED_VA = 1 << 48


class ExpandableMixin:
    """The expandable-segment half of ``DeviceCachingAllocator``; the allocator supplies the pools, the
    counters and ``capacity``."""

    def _find_expandable(self, small: bool, stream: int, size: int) -> Block | None:
        """``find_expandable_block``: the lowest address where free and unmapped blocks together hold
        ``size`` bytes (starting at a free block right before an unmapped one), else a new segment;
        ``None`` when even a new segment is smaller than ``size``."""
        def allocatable(b: Block | None) -> bool:
            return b is not None and not b.allocated

        for _, block in self._unmapped.get((small, stream), ()):
            start = block.prev if allocatable(block.prev) else block
            room, b = 0, start
            while room < size and allocatable(b):
                room += b.size
                b = b.next
            if room >= size:
                return start
        page = K_SMALL_BUFFER if small else self.config.large_segment_size
        # ExpandableSegment's constructor reserves totalGlobalMem + totalGlobalMem / 8, in whole pages.
        reserve = _UNBOUNDED_VA if self.device_total is None else self.device_total + self.device_total // 8
        segment = ExpandableSegment(self._next_addr, page, -(-reserve // page), stream, small)
        if segment.size < size:
            return None  # a single allocation cannot span expandable segments
        self._next_addr += segment.size
        candidate = Block(segment.base, segment.size, stream, small, self._next_reg, segment, mapped=False)
        self._next_reg += 1
        self._insert_unmapped(candidate)
        return candidate

    def _map(self, block: Block, size: int) -> bool:
        """``map_block``: back the first ``size`` bytes of the unmapped ``block`` with whole pages; the rest
        stays unmapped. False when the device has no room for the pages (``cuMemCreate`` fails)."""
        segment = block.segment
        begin = (block.addr - segment.base) // segment.page
        end = -(-(block.addr + size - segment.base) // segment.page)
        mapped = (end - begin) * segment.page
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return False
        self._remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.addr + mapped, block.size - mapped, block.stream, block.small, block.reg, segment,
                         mapped=False)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            self._insert_unmapped(rest)
            block.size = mapped
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert(block)
        segment.mapped += mapped
        self._grow_reserved(mapped)
        return True

    def _allocate_expandable(self, small: bool, stream: int, size: int) -> Block | None:
        """``try_allocate_expandable_block``: map pages until one free block of ``size`` bytes exists;
        it comes back out of the free list."""
        candidate = self._find_expandable(small, stream, size)
        if candidate is None:
            return None
        if not candidate.mapped and not self._map(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next  # free -> unmapped: mapping it merges the two
            if not self._map(following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        self._remove(candidate)
        return candidate

    def _unmap(self, block: Block) -> None:
        """``unmap_block``: give back the pages wholly inside the free ``block``; the partial pages at
        either end stay mapped as free blocks of their own."""
        segment = block.segment
        begin = -(-(block.addr - segment.base) // segment.page)
        end = (block.addr + block.size - segment.base) // segment.page
        if begin >= end:
            return
        self._remove(block)
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
            self._insert(head)
        if after > 0:
            tail = Block(start + unmapped, after, block.stream, block.small, block.reg, segment)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            self._insert(tail)
        block.addr, block.size, block.mapped = start, unmapped, False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert_unmapped(block)
        segment.mapped -= unmapped
        self.reserved -= unmapped
        self.num_device_free += 1

    def _release_expandable(self, block: Block) -> None:
        """``release_expandable_segment``: a segment with nothing mapped gives back its address range."""
        self._remove_unmapped(block)
