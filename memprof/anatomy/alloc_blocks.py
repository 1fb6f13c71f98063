"""Blocks and free lists of the caching-allocator model (``Block`` and ``BlockPool`` of
``c10/cuda/CUDACachingAllocator.cpp``).

torch keeps free blocks of a pool in one ``std::set`` ordered by ``BlockComparatorSizeCounterAddress``:
stream, then size, then the segment's ``registration_counter``, then address. The model keeps one sorted
Python list per (pool, stream) of ``(size, registration, address, block)`` tuples, so best fit is one
``bisect`` (addresses are unique, so the comparison never reaches the block). Unmapped pieces of
expandable segments sit in a second list per (pool, stream) ordered by address (``BlockPool::unmapped``).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable

__all__ = ["Block", "BlockPools", "ExpandableSegment"]


class ExpandableSegment:
    """The virtual range of one expandable segment (``struct ExpandableSegment``): its base, page size and number
    of pages, and the bytes of it mapped now."""

    __slots__ = ("base", "page", "pages", "stream", "small", "mapped")

    def __init__(self, base: int, page: int, pages: int, stream: int, small: bool) -> None:
        self.base, self.page, self.pages, self.stream, self.small = base, page, pages, stream, small
        self.mapped = 0

    @property
    def size(self) -> int:
        return self.page * self.pages


class Block:
    """One block: a piece of a segment, allocated or free, linked to its neighbours in the segment."""

    __slots__ = ("addr", "size", "requested", "stream", "small", "allocated", "mapped", "prev", "next",
                 "reg", "segment", "gc_base")

    def __init__(self, addr: int, size: int, stream: int, small: bool, reg: int,
                 segment: ExpandableSegment | None = None, mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.requested = 0
        self.stream = stream
        self.small = small
        self.allocated = False
        self.mapped = mapped
        self.prev: Block | None = None
        self.next: Block | None = None
        self.reg = reg  # registration_counter of the segment: ties of equal size go to older segments
        self.segment = segment  # the ExpandableSegment it lies in, None for a cudaMalloc segment
        self.gc_base = 0  # get_free_blocks_call_count of its pool when it was last put in the free list

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("free" if self.mapped else "unmapped")
        return f"Block({self.size} B {state} at {self.addr:#x}, stream {self.stream})"


class BlockPools:
    """Free and unmapped blocks per (small pool?, stream), with torch's insert/erase/merge rules."""

    def __init__(self) -> None:
        self._free: dict[tuple[bool, int], list[tuple[int, int, int, Block]]] = {}
        self._unmapped: dict[tuple[bool, int], list[tuple[int, Block]]] = {}
        # BlockPool::get_free_blocks_call_count of the small (True) and large (False) pools: the clock of
        # the garbage collector's block ages.
        self._gc_calls = {True: 0, False: 0}

    def _insert(self, block: Block) -> None:
        """``BlockPool::insert_into_blocks``: a free block starts a new age."""
        block.gc_base = self._gc_calls[block.small]
        free = self._free.get((block.small, block.stream))
        if free is None:
            free = self._free[(block.small, block.stream)] = []
        insort(free, (block.size, block.reg, block.addr, block))

    def _remove(self, block: Block) -> None:
        free = self._free[(block.small, block.stream)]
        del free[bisect_left(free, (block.size, block.reg, block.addr))]

    def _insert_unmapped(self, block: Block) -> None:
        key = (block.small, block.stream)
        unmapped = self._unmapped.get(key)
        if unmapped is None:
            unmapped = self._unmapped[key] = []
        insort(unmapped, (block.addr, block))

    def _remove_unmapped(self, block: Block) -> None:
        unmapped = self._unmapped[(block.small, block.stream)]
        del unmapped[bisect_left(unmapped, (block.addr,))]

    def _merge(self, dst: Block, src: Block | None) -> int:
        """``try_merge_blocks``: fold the free neighbour ``src`` into ``dst`` (which is in no list);
        returns the bytes taken over, 0 if ``src`` is absent, in use, or mapped differently."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            self._remove(src)
        else:
            self._remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _streams(self, small: bool) -> list[int]:
        # torch orders a pool's set by stream first (the cudaStream_t pointer); the model orders stream ids.
        return sorted(stream for (is_small, stream) in self._free if is_small == small)

    def _free_blocks(self, small: bool) -> list[Block]:
        """Every free block of one pool in the set's order: stream, size, registration, address."""
        return [entry[3] for stream in self._streams(small) for entry in self._free[(small, stream)]]

    def _all_blocks(self, live: Iterable[Block | None]) -> list[Block]:
        blocks = [entry[3] for free in self._free.values() for entry in free]
        blocks += [entry[1] for unmapped in self._unmapped.values() for entry in unmapped]
        blocks += [b for b in live if b is not None]
        return blocks
