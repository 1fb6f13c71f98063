"""Views of the caching-allocator model in torch's own shapes: ``memory_snapshot()`` segments
(``DeviceCachingAllocator::snapshot``) and ``memory_stats()`` keys (``DeviceStats`` in
``c10/core/CachingDeviceAllocator.h``), so a prediction can be laid next to a real run."""

from __future__ import annotations

from .alloc_blocks import Block

__all__ = ["SnapshotMixin"]


class SnapshotMixin:
    """Read-only views; the allocator supplies its blocks and counters."""

    def _segment_heads(self) -> list[Block]:
        # snapshot() reports one segment per cudaMalloc and, for an expandable segment, one per contiguous
        # mapped range (a mapped block whose predecessor is absent or unmapped starts one).
        heads = [b for b in self._all_blocks(self._live.values())
                 if b.mapped and (b.prev is None or not b.prev.mapped)]
        return sorted(heads, key=lambda b: b.addr)

    @staticmethod
    def _run(head: Block) -> list[Block]:
        blocks, block = [], head
        while block is not None and block.mapped:
            blocks.append(block)
            block = block.next
        return blocks

    def segments(self) -> list[tuple[int, list[tuple[int, bool]]]]:
        """``[(segment_bytes, [(block_bytes, allocated), ...]), ...]`` in address order (segments in the
        order they were made, blocks in address order within each)."""
        out = []
        for head in self._segment_heads():
            blocks = self._run(head)
            out.append((sum(b.size for b in blocks), [(b.size, b.allocated) for b in blocks]))
        return out

    def snapshot(self) -> list[dict]:
        """The segments as ``torch.cuda.memory_snapshot()`` lists them (addresses are the model's own)."""
        out = []
        for head in self._segment_heads():
            blocks = self._run(head)
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

    @property
    def inactive_split_bytes(self) -> int:
        """Free bytes in segments that are split (``inactive_split_bytes``; torch leaves expandable
        segments out of this statistic)."""
        return sum(entry[0] for free in self._free.values() for entry in free
                   if entry[3].segment is None and entry[3].is_split)

    def memory_stats(self) -> dict[str, int]:
        """The counters under ``torch.cuda.memory_stats()``'s key names (the ``all`` aggregate)."""
        stats = {"num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms,
                 "num_oom_rejections": self.num_oom_rejections, "num_device_alloc": self.num_device_alloc,
                 "num_device_free": self.num_device_free,
                 "segment.all.current": self.segment_count,
                 "inactive_split_bytes.all.current": self.inactive_split_bytes,
                 "oversize_allocations.current": self.oversize_allocations,
                 "oversize_segments.current": self.oversize_segments}
        for name in ("allocated", "reserved", "active", "requested"):
            stats[f"{name}_bytes.all.current"] = getattr(self, name)
            stats[f"{name}_bytes.all.peak"] = getattr(self, f"peak_{name}")
        return stats
