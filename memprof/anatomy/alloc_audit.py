"""The caching-allocator model's invariants, checked on demand: in tests, and in any replay when
``MEMPROF_CHECK_REPLAY=1`` (:func:`memprof.simulate.device_memory.device_memory`). Never on a replay's normal
path: an audit walks every block, so a checked replay costs time quadratic in the blocks.

What an audit holds, after every ``malloc`` and ``free``:

* the segments tile their address range, free neighbours of one mapping state are merged, and the free lists
  hold exactly the free mapped blocks, in torch's order (``BlockComparatorSize``);
* ``reserved`` is the bytes of the mapped blocks, and never above the device (``capacity``) nor above the
  memory fraction's ``allowed_memory_maximum``;
* ``allocated`` is the bytes of the live blocks, and each live block is the request rounded as torch rounds it
  (``round_size``) plus at most the remainder torch leaves unsplit: none in the small pool or an expandable
  segment (``should_split``: a remainder of ``kMinBlockSize`` splits), at most ``kSmallSize`` (1 MiB) in the
  large pool below ``max_split_size``, less than ``max_non_split_rounding`` above it (``get_free_block``).
  torch counts that remainder as allocated (``alloc_found_block`` adds ``block->size``);
* the live blocks are exactly the live requests: the audit keeps its own count of what was asked for and
  not freed, so ``allocated`` = the live requests, rounded, plus their unsplit remainders.

A violation raises ``AssertionError`` naming the invariant: it is a defect of the model, not of the input.
"""

from __future__ import annotations

from .alloc_blocks import Block
from .alloc_config import K_MIN_BLOCK_SIZE, K_SMALL_SIZE, AllocatorConfig
from .allocator import CachingAllocator, round_size

__all__ = ["AuditedAllocator", "audit", "unsplit_bound"]


def unsplit_bound(allocator: CachingAllocator, block: Block) -> int:
    """The most a live block may exceed its rounded request by: the remainder ``should_split`` leaves whole."""
    if block.small or block.segment is not None:
        return K_MIN_BLOCK_SIZE - 1  # split from 512 bytes on; sizes are multiples of 512, so nothing is left
    size = round_size(block.requested, allocator.config)
    limit = allocator.config.max_split_size
    if limit is None or size < limit:
        return K_SMALL_SIZE  # remaining > kSmallSize splits
    # An oversize request takes a cached block under size + max_non_split_rounding, or a new segment rounded
    # up to 2 MiB (less than max_non_split_rounding, which is at least large_segment_size: 20 MiB).
    return allocator.config.max_non_split_rounding - 1


def _fail(what: str) -> None:
    raise AssertionError(f"caching-allocator model invariant broken: {what}")


def _check_links(blocks: list[Block]) -> None:
    if len({id(b) for b in blocks}) != len(blocks):
        _fail("a block is in two places (free list, unmapped list, live)")
    for block in blocks:
        after = block.next
        if after is None:
            continue
        if after.prev is not block or block.addr + block.size != after.addr:
            _fail(f"{block} and the block after it do not tile the segment")
        if not block.allocated and not after.allocated and block.mapped == after.mapped:
            _fail(f"{block} and {after} are free neighbours of one mapping state, not merged")


def _check_lists(allocator: CachingAllocator, blocks: list[Block]) -> None:
    listed = [entry for free in allocator.pools.free.values() for entry in free]
    if sorted(id(e[3]) for e in listed) != sorted(id(b) for b in blocks if b.mapped and not b.allocated):
        _fail("the free lists do not hold exactly the free mapped blocks")
    for free in allocator.pools.free.values():
        if any(e[:3] != (e[3].size, e[3].reg, e[3].addr) for e in free) or free != sorted(free, key=lambda e: e[:3]):
            _fail("a free list is out of torch's order (size, segment, address)")


def _check_counters(allocator: CachingAllocator, blocks: list[Block]) -> None:
    mapped = sum(b.size for b in blocks if b.mapped)
    waiting = {id(b) for b in allocator.awaiting.values()}  # freed, out of the cache until their events complete
    if sum(b.size for b in allocator.awaiting.values()) != allocator.awaiting_bytes:
        _fail(f"awaiting {allocator.awaiting_bytes} B is not the awaiting blocks' sum")
    live = [b for b in blocks if b.allocated and id(b) not in waiting]
    if mapped != allocator.reserved:
        _fail(f"reserved {allocator.reserved} B is not the mapped blocks' {mapped} B")
    if sum(b.size for b in live) != allocator.allocated:
        _fail(f"allocated {allocator.allocated} B is not the live blocks' {sum(b.size for b in live)} B")
    if sum(b.requested for b in live) != allocator.requested:
        _fail(f"requested {allocator.requested} B is not the live requests' sum")
    if allocator.capacity is not None and allocator.reserved > allocator.capacity:
        _fail(f"reserved {allocator.reserved} B is above the capacity {allocator.capacity} B")
    allowed = allocator.allowed_memory_maximum
    if allowed is not None and allocator.reserved > allowed:
        _fail(f"reserved {allocator.reserved} B is above the memory fraction's {allowed} B")
    if allocator.peak_allocated < allocator.allocated or allocator.peak_reserved < allocator.reserved:
        _fail("a peak is below its current value")
    for b in live:
        rounded = round_size(b.requested, allocator.config)
        if not 0 <= b.size - rounded <= unsplit_bound(allocator, b):
            _fail(f"{b} serves a {b.requested} B request (rounded {rounded} B) with more than torch leaves unsplit")
        if b.small != (rounded <= K_SMALL_SIZE):
            _fail(f"{b} is in the wrong pool for a {b.requested} B request")


def audit(allocator: CachingAllocator) -> None:
    """Check every invariant above that the allocator can check alone (not the live requests: see
    :class:`AuditedAllocator`); raises ``AssertionError`` naming the first broken one."""
    blocks = allocator.blocks()
    _check_links(blocks)
    _check_lists(allocator, blocks)
    _check_counters(allocator, blocks)


class AuditedAllocator(CachingAllocator):
    """A :class:`CachingAllocator` that audits itself after every ``malloc``, ``free`` and ``empty_cache``, and
    keeps its own count of the live requests: ``live_rounded`` (each request rounded as torch rounds it) must
    equal the live blocks' rounded requests, so that ``allocated`` is the live requests, rounded, plus the
    remainders torch leaves unsplit, each within :func:`unsplit_bound`."""

    def __init__(self, config: AllocatorConfig | None = None, capacity: int | None = None,
                 device_total: int | None = None) -> None:
        super().__init__(config, capacity, device_total)
        self._asked: dict[int, int] = {}
        self.live_rounded = 0

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        try:
            handle = super().malloc(nbytes, stream)
        except BaseException:
            self.check()  # an out-of-memory error leaves the state whole too (after torch's frees and retries)
            raise
        rounded = round_size(nbytes, self.config) if nbytes else 0
        self._asked[handle] = rounded
        self.live_rounded += rounded
        self.check()
        return handle

    def free(self, handle: int, *, awaiting: bool = False) -> None:
        super().free(handle, awaiting=awaiting)
        self.live_rounded -= self._asked.pop(handle)
        self.check()

    def release_awaiting(self, handle: int) -> None:
        super().release_awaiting(handle)
        self.check()

    def empty_cache(self) -> None:
        super().empty_cache()
        self.check()

    @property
    def unsplit(self) -> int:
        """The bytes live blocks hold beyond their rounded requests (torch counts them as allocated)."""
        return sum(b.size - round_size(b.requested, self.config) for b in self._live.values() if b is not None)

    def check(self) -> None:
        audit(self)
        held = sum(round_size(b.requested, self.config) for b in self._live.values() if b is not None)
        if held != self.live_rounded or len(self._asked) != len(self._live):
            _fail(f"the live blocks hold {held} B of rounded requests, the live requests are {self.live_rounded} B")
        if self.allocated != self.live_rounded + self.unsplit:
            _fail(f"allocated {self.allocated} B is not the live requests' {self.live_rounded} B plus their "
                  f"unsplit remainders {self.unsplit} B")
