"""Random allocation streams through every configuration keep the model's bookkeeping whole: segments tile
their range, free neighbours are always merged, the free lists hold exactly the free blocks, and the
counters are the sums over the blocks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from memprof.anatomy.alloc_config import AllocatorConfig
from memprof.anatomy.allocator import CachingAllocator
from memprof.errors import SimulatedOutOfMemoryError

MiB = 2**20
CONFIGS = [
    "",
    "max_split_size_mb:40",
    "expandable_segments:True",
    "roundup_power2_divisions:[256:4,>:8]",
    "per_process_memory_fraction:0.8,garbage_collection_threshold:0.6",
    "large_segment_size_mb:32,max_split_size_mb:64,max_non_split_rounding_mb:40",
]


def check(alloc: CachingAllocator) -> None:
    blocks = alloc.blocks()
    assert len({id(b) for b in blocks}) == len(blocks)  # no block in two places
    mapped_total = allocated_total = 0
    for block in blocks:
        if block.next is not None:
            assert block.next.prev is block and block.addr + block.size == block.next.addr
            # free_block and map/unmap merge neighbours of the same mapping state
            assert not (not block.allocated and not block.next.allocated and block.mapped == block.next.mapped)
        if block.mapped:
            mapped_total += block.size
        if block.allocated:
            allocated_total += block.size
    assert mapped_total == alloc.reserved and allocated_total == alloc.allocated
    listed = [entry for free in alloc.pools.free.values() for entry in free]
    assert sorted(id(e[3]) for e in listed) == sorted(id(b) for b in blocks if b.mapped and not b.allocated)
    for free in alloc.pools.free.values():
        assert free == sorted(free, key=lambda e: e[:3])
        assert all(e[:3] == (e[3].size, e[3].reg, e[3].addr) for e in free)
    assert alloc.peak_reserved >= alloc.reserved and alloc.peak_allocated >= alloc.allocated


sizes = st.one_of(st.integers(0, 4096), st.integers(4097, 2 * MiB), st.integers(2 * MiB, 64 * MiB))
ops = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "alloc", "free", "free", "empty"]), sizes,
                         st.integers(0, 1), st.integers(0, 10**6)), min_size=1, max_size=120)


@settings(max_examples=60, deadline=None)
@given(config=st.sampled_from(CONFIGS), stream=ops, capacity=st.sampled_from([None, 256 * MiB]))
def test_random_streams_keep_the_bookkeeping_whole(config, stream, capacity):
    alloc = CachingAllocator(AllocatorConfig.parse(config), capacity=capacity, device_total=512 * MiB)
    live = []
    for op, size, stream_id, pick in stream:
        if op == "alloc":
            try:
                live.append(alloc.malloc(size, stream_id))
            except SimulatedOutOfMemoryError:
                assert capacity is not None or "fraction" in config
        elif op == "free" and live:
            alloc.free(live.pop(pick % len(live)))
        elif op == "empty":
            alloc.empty_cache()
        check(alloc)
    for handle in live:
        alloc.free(handle)
    alloc.empty_cache()
    check(alloc)
    assert (alloc.allocated, alloc.reserved) == (0, 0)  # with nothing live, empty_cache gives back everything
