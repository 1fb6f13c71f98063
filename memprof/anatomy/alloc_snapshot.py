"""Views of the caching-allocator model in torch's own shapes: ``memory_snapshot()`` segments
(``DeviceCachingAllocator::snapshot``) and ``memory_stats()`` keys (``DeviceStats`` in
``c10/core/CachingDeviceAllocator.h``), so a prediction can be laid next to a real run.

The segment views read the blocks (:class:`~memprof.anatomy.alloc_blocks.BlockPools` and the live blocks); the
statistics read the counters a :class:`StatsHost` declares.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from .alloc_blocks import Block, BlockPools
from .alloc_config import AllocatorConfig

__all__ = ["StatsHost", "segments", "snapshot", "inactive_split_bytes", "memory_stats"]

#: A snapshot entry, as ``torch.cuda.memory_snapshot()`` gives one: ints, strings, a bool, a list of blocks.
SnapshotSegment = dict[str, object]


class StatsHost(Protocol):
    """The counters :func:`memory_stats` reads, named as ``torch.cuda.memory_stats()`` names them."""

    @property
    def config(self) -> AllocatorConfig: ...
    @property
    def pools(self) -> BlockPools: ...
    @property
    def allocated(self) -> int: ...
    @property
    def reserved(self) -> int: ...
    @property
    def requested(self) -> int: ...
    @property
    def active(self) -> int: ...
    @property
    def peak_allocated(self) -> int: ...
    @property
    def peak_reserved(self) -> int: ...
    @property
    def peak_requested(self) -> int: ...
    @property
    def peak_active(self) -> int: ...
    @property
    def num_alloc_retries(self) -> int: ...
    @property
    def num_ooms(self) -> int: ...
    @property
    def num_oom_rejections(self) -> int: ...
    @property
    def num_device_alloc(self) -> int: ...
    @property
    def num_device_free(self) -> int: ...
    @property
    def segment_count(self) -> int: ...
    @property
    def oversize_allocations(self) -> int: ...
    @property
    def oversize_segments(self) -> int: ...
    @property
    def peak_oversize_allocations(self) -> int: ...
    @property
    def peak_oversize_segments(self) -> int: ...


def _segment_heads(pools: BlockPools, live: Iterable[Block | None]) -> list[Block]:
    # snapshot() reports one segment per cudaMalloc and, for an expandable segment, one per contiguous
    # mapped range (a mapped block whose predecessor is absent or unmapped starts one).
    heads = [b for b in pools.all_blocks(live) if b.mapped and (b.prev is None or not b.prev.mapped)]
    return sorted(heads, key=lambda b: b.addr)


def _run(head: Block) -> list[Block]:
    blocks = []
    block: Block | None = head
    while block is not None and block.mapped:
        blocks.append(block)
        block = block.next
    return blocks


def segments(pools: BlockPools, live: Iterable[Block | None]) -> list[tuple[int, list[tuple[int, bool]]]]:
    """``[(segment_bytes, [(block_bytes, allocated), ...]), ...]`` in address order (segments in the
    order they were made, blocks in address order within each)."""
    out = []
    for head in _segment_heads(pools, live):
        blocks = _run(head)
        out.append((sum(b.size for b in blocks), [(b.size, b.allocated) for b in blocks]))
    return out


def snapshot(pools: BlockPools, live: Iterable[Block | None]) -> list[SnapshotSegment]:
    """The segments as ``torch.cuda.memory_snapshot()`` lists them (addresses are the model's own)."""
    out: list[SnapshotSegment] = []
    for head in _segment_heads(pools, live):
        blocks = _run(head)
        out.append({
            "address": head.addr,
            "total_size": sum(b.size for b in blocks),
            "stream": head.stream,
            "segment_type": "small" if head.small else "large",
            "allocated_size": sum(b.size for b in blocks if b.allocated),
            "active_size": sum(b.size for b in blocks if b.allocated),
            "requested_size": sum(b.requested for b in blocks if b.allocated),
            "is_expandable": head.segment is not None,
            "blocks": [{"size": b.size, "requested_size": b.requested if b.allocated else 0,
                        "state": "active_allocated" if b.allocated else "inactive"} for b in blocks],
        })
    return out


def inactive_split_bytes(pools: BlockPools) -> int:
    """Free bytes in segments that are split (``inactive_split_bytes``; torch leaves expandable
    segments out of this statistic)."""
    return sum(entry[0] for free in pools.free.values() for entry in free
               if entry[3].segment is None and entry[3].is_split)


def memory_stats(host: StatsHost) -> dict[str, int]:
    """The counters under ``torch.cuda.memory_stats()``'s key names (the ``all`` aggregate)."""
    return {"num_alloc_retries": host.num_alloc_retries, "num_ooms": host.num_ooms,
            "num_oom_rejections": host.num_oom_rejections, "num_device_alloc": host.num_device_alloc,
            "num_device_free": host.num_device_free,
            "segment.all.current": host.segment_count,
            "inactive_split_bytes.all.current": inactive_split_bytes(host.pools),
            "oversize_allocations.current": host.oversize_allocations,
            "oversize_allocations.peak": host.peak_oversize_allocations,
            "oversize_segments.current": host.oversize_segments,
            "oversize_segments.peak": host.peak_oversize_segments,
            # DeviceStats::max_split_size is static_cast<int64_t>(max_split_size()): SIZE_MAX ("no limit") is -1
            "max_split_size": -1 if host.config.max_split_size is None else host.config.max_split_size,
            "allocated_bytes.all.current": host.allocated, "allocated_bytes.all.peak": host.peak_allocated,
            "reserved_bytes.all.current": host.reserved, "reserved_bytes.all.peak": host.peak_reserved,
            "active_bytes.all.current": host.active, "active_bytes.all.peak": host.peak_active,
            "requested_bytes.all.current": host.requested, "requested_bytes.all.peak": host.peak_requested}
