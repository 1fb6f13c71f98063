"""How the caching-allocator model gives memory back: ``release_block``, ``release_available_cached_blocks``,
``release_cached_blocks`` (``empty_cache``) and ``garbage_collect_cached_blocks`` of
``c10/cuda/CUDACachingAllocator.cpp``."""

from __future__ import annotations

from bisect import bisect_left

from .alloc_blocks import Block

__all__ = ["ReleaseMixin"]


class ReleaseMixin:
    """The freeing half of ``DeviceCachingAllocator``; the allocator supplies pools, counters and config."""

    def _release_block(self, block: Block) -> None:
        """``release_block``: ``cudaFree`` of a whole free segment (already out of the free list)."""
        self.reserved -= block.size
        self.segment_count -= 1
        self.num_device_free += 1
        if self.config.max_split_size is not None and block.size >= self.config.max_split_size:
            self.oversize_segments -= 1

    def _release_available(self, small: bool, stream: int, size: int) -> bool:
        """``release_available_cached_blocks``: with a ``max_split_size``, free the smallest oversize block
        of the stream that covers the request, else oversize blocks from the largest down until enough."""
        limit = self.config.max_split_size
        if limit is None:
            return False
        free = self._free.get((small, stream), [])
        target = max(size, limit)
        i = bisect_left(free, (target,))
        if i < len(free) and free[i][3].segment is None:
            self._release_block(free.pop(i)[3])
            return True
        released = 0
        i -= 1
        while i >= 0 and released < target and free[i][0] >= limit:
            block = free[i][3]
            if block.segment is None:
                del free[i]
                released += block.size
                self._release_block(block)
            i -= 1
        return released >= target

    def _release_cached(self) -> None:
        """``release_cached_blocks`` -> ``release_blocks`` of the large then the small pool: whole free
        segments are freed; expandable blocks are unmapped, and their segment freed once fully unmapped."""
        for small in (False, True):
            to_unmap = []
            for stream in self._streams(small):
                free = self._free[(small, stream)]
                kept = []
                for entry in free:
                    block = entry[3]
                    if block.segment is not None:
                        kept.append(entry)
                        to_unmap.append(block)
                    elif block.prev is None and block.next is None:
                        self._release_block(block)
                    else:
                        kept.append(entry)
                free[:] = kept
            for block in to_unmap:
                self._unmap(block)
                if not block.mapped and block.prev is None and block.next is None:
                    self._release_expandable(block)

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: above ``threshold * allowed memory``, free unsplit large
        blocks at least as old (in ``get_free_block`` calls) as the average, until the excess is freed."""
        threshold = int(self.config.garbage_collection_threshold * self._allowed_max)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        clock = self._gc_calls[False]
        unsplit = [b for b in self._free_blocks(False) if not b.is_split]
        total_age, count = sum(clock - b.gc_base for b in unsplit), len(unsplit)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            average = total_age / count
            freed = False
            # Every block of the pass is freed once it is old enough, even past the target, so that the
            # collection does not run again at once.
            for block in self._free_blocks(False):
                age = clock - block.gc_base
                if not block.is_split and block.segment is None and age >= average:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._remove(block)
                    self._release_block(block)
