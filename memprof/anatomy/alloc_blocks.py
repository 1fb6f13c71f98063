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

__all__ = ["Block", "BlockPools", "ExpandableSegment", "AddressSpace"]


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
    """Free and unmapped blocks per (small pool?, stream), with torch's insert/erase/merge rules.

    ``free`` maps (small, stream) to its sorted ``(size, registration, address, block)`` list, ``unmapped`` to
    its ``(address, block)`` list; ``gc_calls`` is ``BlockPool::get_free_blocks_call_count`` of the small (True)
    and large (False) pools: the clock of the garbage collector's block ages."""

    __slots__ = ("free", "unmapped", "gc_calls")

    def __init__(self) -> None:
        self.free: dict[tuple[bool, int], list[tuple[int, int, int, Block]]] = {}
        self.unmapped: dict[tuple[bool, int], list[tuple[int, Block]]] = {}
        self.gc_calls = {True: 0, False: 0}

    def insert(self, block: Block) -> None:
        """``BlockPool::insert_into_blocks``: a free block starts a new age."""
        block.gc_base = self.gc_calls[block.small]
        free = self.free.get((block.small, block.stream))
        if free is None:
            free = self.free[(block.small, block.stream)] = []
        insort(free, (block.size, block.reg, block.addr, block))

    def remove(self, block: Block) -> None:
        free = self.free[(block.small, block.stream)]
        del free[bisect_left(free, (block.size, block.reg, block.addr))]

    def insert_unmapped(self, block: Block) -> None:
        key = (block.small, block.stream)
        unmapped = self.unmapped.get(key)
        if unmapped is None:
            unmapped = self.unmapped[key] = []
        insort(unmapped, (block.addr, block))

    def remove_unmapped(self, block: Block) -> None:
        unmapped = self.unmapped[(block.small, block.stream)]
        del unmapped[bisect_left(unmapped, (block.addr,))]

    def merge(self, dst: Block, src: Block | None) -> int:
        """``try_merge_blocks``: fold the free neighbour ``src`` into ``dst`` (which is in no list);
        returns the bytes taken over, 0 if ``src`` is absent, in use, or mapped differently."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            self.remove(src)
        else:
            self.remove_unmapped(src)
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

    def streams(self, small: bool) -> list[int]:
        # torch orders a pool's set by stream first (the cudaStream_t pointer); the model orders stream ids.
        return sorted(stream for (is_small, stream) in self.free if is_small == small)

    def free_blocks(self, small: bool) -> list[Block]:
        """Every free block of one pool in the set's order: stream, size, registration, address."""
        return [entry[3] for stream in self.streams(small) for entry in self.free[(small, stream)]]

    def all_blocks(self, live: Iterable[Block | None]) -> list[Block]:
        """The free and unmapped blocks, then those of ``live`` (the allocated ones; None for a zero-byte request)."""
        blocks = [entry[3] for free in self.free.values() for entry in free]
        blocks += [entry[1] for unmapped in self.unmapped.values() for entry in unmapped]
        blocks += [b for b in live if b is not None]
        return blocks


class AddressSpace:
    """Where the model places segments: synthetic addresses, which only order blocks inside one segment (the
    driver's own placement is not modelled), and the ``registration_counter`` that makes ties of equal size go
    to older segments."""

    __slots__ = ("next_addr", "next_reg")

    def __init__(self) -> None:
        self.next_addr = 1 << 32
        self.next_reg = 0

    def take(self, length: int) -> tuple[int, int]:
        """The address and registration of a new segment spanning ``length`` bytes of addresses."""
        addr, reg = self.next_addr, self.next_reg
        self.next_addr += length
        self.next_reg += 1
        return addr, reg
