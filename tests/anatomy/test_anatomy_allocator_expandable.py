"""expandable_segments:True in the caching-allocator model (ExpandableSegment, find_expandable_block, map_block,
unmap_block in c10/cuda/CUDACachingAllocator.cpp). Device of 1 GiB: each segment reserves 1 GiB + 1/8 =
1152 MiB of addresses, 58 pages of 20 MiB in the large pool. MiB = 2**20."""

from __future__ import annotations

import pytest

from memprof.anatomy.alloc_config import AllocatorConfig
from memprof.anatomy.allocator import CachingAllocator
from memprof.errors import SimulatedOutOfMemoryError

MiB = 2**20
EXPANDABLE = AllocatorConfig.parse("expandable_segments:True")


def layout(alloc):
    return [(size / MiB, [(b / MiB, used) for b, used in blocks]) for size, blocks in alloc.segments()]


def test_one_growing_segment_mapped_in_20_mib_pages():
    alloc = CachingAllocator(EXPANDABLE, device_total=1024 * MiB)
    a = alloc.malloc(30 * MiB)  # maps ceil(30 / 20) = 2 pages = 40 MiB; splits 30 + 10 (rest >= 512 B)
    assert alloc.reserved == 40 * MiB and layout(alloc) == [(40, [(30, True), (10, False)])]
    # 15 MiB: the free 10 MiB at the end plus unmapped space behind it; one more page, merged: 30 MiB free
    b = alloc.malloc(15 * MiB)
    assert alloc.reserved == 60 * MiB and layout(alloc) == [(60, [(30, True), (15, True), (15, False)])]
    (segment,) = alloc.snapshot()
    assert segment["is_expandable"] is True
    alloc.free(a)
    # empty_cache unmaps the pages wholly inside free blocks: page 0 of the 30 MiB block; its last 10 MiB
    # share page 1 with b and stay mapped; the 15 MiB tail (45-60 MiB) lies within page 2, shared with b
    alloc.empty_cache()
    assert alloc.reserved == 40 * MiB and layout(alloc) == [(40, [(10, False), (15, True), (15, False)])]
    # 50 MiB: the unmapped hole at 0-20 MiB plus the free 10 MiB is only 30; the free 15 MiB tail plus the
    # unmapped range behind it serves, mapping 2 pages (60-100 MiB); 55 MiB free block split 50 + 5
    c = alloc.malloc(50 * MiB)
    assert alloc.reserved == 80 * MiB
    assert layout(alloc) == [(80, [(10, False), (15, True), (50, True), (5, False)])]
    alloc.free(b)
    alloc.free(c)
    alloc.empty_cache()  # the one free 80 MiB run is unmapped and the segment's address range goes back
    # three maps (for a, b, c) and two unmaps (page 0, then the 80 MiB run)
    assert (alloc.reserved, alloc.segments(), alloc.num_device_alloc, alloc.num_device_free) == (0, [], 3, 2)


def test_small_pool_pages_are_2_mib():
    alloc = CachingAllocator(EXPANDABLE, device_total=1024 * MiB)
    alloc.malloc(600 * 1024)  # small pool: one 2 MiB page
    assert alloc.reserved == 2 * MiB and layout(alloc) == [(2, [(600 / 1024, True), ((2048 - 600) / 1024, False)])]


def test_an_unmapped_hole_is_filled_first():
    alloc = CachingAllocator(EXPANDABLE, device_total=1024 * MiB)
    a, b = alloc.malloc(20 * MiB), alloc.malloc(20 * MiB)  # pages 0 and 1
    alloc.free(a)
    alloc.empty_cache()  # page 0 unmapped: a hole before b
    assert alloc.reserved == 20 * MiB
    alloc.malloc(20 * MiB)  # the lowest address with room: the hole, mapped again
    assert layout(alloc) == [(40, [(20, True), (20, True)])]
    assert alloc.reserved == 40 * MiB
    alloc.free(b)


def test_a_request_larger_than_the_address_range_is_out_of_memory():
    alloc = CachingAllocator(EXPANDABLE, device_total=64 * MiB)  # 72 MiB of addresses: 4 pages = 80 MiB
    alloc.malloc(80 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError):
        alloc.malloc(81 * MiB)  # no segment can ever hold it (a single allocation cannot span segments)


def test_mapping_stops_at_the_capacity():
    alloc = CachingAllocator(EXPANDABLE, capacity=60 * MiB)
    keep = alloc.malloc(40 * MiB)  # 2 pages
    with pytest.raises(SimulatedOutOfMemoryError):
        alloc.malloc(30 * MiB)  # 2 more pages would make 80 MiB > 60 MiB
    assert alloc.reserved == 40 * MiB and alloc.num_ooms == 1
    alloc.free(keep)
    alloc.malloc(30 * MiB)  # the same pages serve once free
    assert alloc.reserved == 40 * MiB


def test_reserved_grows_in_pages_where_segments_would_fragment():
    # Growing batches: each step needs a little more than the last. Plain segments keep the old, too
    # small ones cached; one expandable segment reuses its pages.
    def run(config):
        alloc = CachingAllocator(config, device_total=4096 * MiB)
        for n in (100, 110, 120, 130):
            handles = [alloc.malloc(n * MiB) for _ in range(3)]
            for h in handles:
                alloc.free(h)
        return alloc.reserved
    # plain: 3 segments of each size stay cached: 3 * (100 + 110 + 120 + 130) = 1380 MiB
    assert run(AllocatorConfig()) == 1380 * MiB
    # expandable: the last step needs 3 * 130 = 390 MiB = 19.5 pages -> 20 pages = 400 MiB
    assert run(EXPANDABLE) == 400 * MiB
