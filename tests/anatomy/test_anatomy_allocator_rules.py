"""The caching-allocator model, rule by rule (DeviceCachingAllocator in c10/cuda/CUDACachingAllocator.cpp),
each on a hand-built sequence with the expected layout and its arithmetic written out. MiB = 2**20."""

from __future__ import annotations

import pytest

from memprof.anatomy.alloc_config import AllocatorConfig
from memprof.anatomy.allocator import CachingAllocator
from memprof.errors import InvalidArgumentError, SimulatedOutOfMemoryError

MiB = 2**20


def layout(alloc):
    """Segments in MiB: [(segment, [(block, allocated), ...]), ...]."""
    return [(size / MiB, [(b / MiB, used) for b, used in blocks]) for size, blocks in alloc.segments()]


def test_blocks_are_cached_per_stream():
    alloc = CachingAllocator()
    a = alloc.malloc(4 * MiB, stream=0)  # 4 MiB < 10 MiB -> a 20 MiB segment, split 4 + 16
    alloc.free(a)
    alloc.malloc(4 * MiB, stream=1)  # stream 0's free 20 MiB is not reused on stream 1: a second segment
    assert alloc.reserved == 40 * MiB
    alloc.malloc(4 * MiB, stream=0)  # back on stream 0 the cached block serves
    assert alloc.reserved == 40 * MiB and alloc.allocated == 8 * MiB
    assert layout(alloc) == [(20, [(4, True), (16, False)]), (20, [(4, True), (16, False)])]


def test_best_fit_prefers_the_older_segment_on_equal_sizes():
    alloc = CachingAllocator()
    first, second = alloc.malloc(12 * MiB), alloc.malloc(12 * MiB)  # two 12 MiB segments
    alloc.free(second)
    alloc.free(first)
    # equal sizes tie on the segment's registration_counter: the first segment made serves
    alloc.malloc(12 * MiB)
    assert layout(alloc) == [(12, [(12, True)]), (12, [(12, False)])]


def test_max_split_size_keeps_oversize_blocks_whole():
    alloc = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:40"))
    big = alloc.malloc(64 * MiB)
    alloc.free(big)
    # 30 MiB < 40 MiB <= 64 MiB: an oversize block never serves a smaller request -> a new 30 MiB segment
    small = alloc.malloc(30 * MiB)
    assert alloc.reserved == 94 * MiB
    alloc.free(small)
    # 44 MiB >= 40 MiB but 64 >= 44 + 20 (max_non_split_rounding): refused, a new 44 MiB segment
    h44 = alloc.malloc(44 * MiB)
    assert alloc.reserved == 138 * MiB
    alloc.free(h44)
    # 46 MiB: the 64 MiB block fits within 46 + 20 = 66 MiB; 44 MiB < 46 is too small; 64 serves, unsplit
    alloc.malloc(46 * MiB)
    assert alloc.allocated == 64 * MiB and alloc.reserved == 138 * MiB
    assert alloc.oversize_allocations == 1 and alloc.oversize_segments == 2  # the 64 and 44 MiB segments


def test_large_blocks_split_only_below_max_split_size():
    alloc = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:20"))
    h = alloc.malloc(30 * MiB)
    alloc.free(h)
    # 24 MiB >= max_split_size: no split; 30 < 24 + 20 so it is reused whole
    alloc.malloc(24 * MiB)
    assert layout(alloc) == [(30, [(30, True)])]


def test_free_merges_both_neighbours_and_empty_cache_releases_whole_segments():
    alloc = CachingAllocator()
    a, b, c = alloc.malloc(2 * MiB), alloc.malloc(3 * MiB), alloc.malloc(4 * MiB)  # one 20 MiB segment
    assert layout(alloc) == [(20, [(2, True), (3, True), (4, True), (11, False)])]
    alloc.free(a)
    alloc.free(c)  # merges with the 11 MiB tail
    assert layout(alloc) == [(20, [(2, False), (3, True), (15, False)])]
    alloc.empty_cache()  # the segment is still split around b: nothing goes back
    assert alloc.reserved == 20 * MiB and alloc.inactive_split_bytes == 17 * MiB
    alloc.free(b)  # 2 + 3 + 15 merge into one free 20 MiB block
    assert layout(alloc) == [(20, [(20, False)])]
    alloc.empty_cache()
    assert (alloc.reserved, alloc.segment_count, alloc.num_device_free) == (0, 0, 1)


def test_oom_retry_frees_the_cache_then_raises():
    alloc = CachingAllocator(capacity=100 * MiB)
    h = alloc.malloc(60 * MiB)
    alloc.free(h)
    # 60 cached + 70 new > 100: cudaMalloc fails, release_cached_blocks frees the 60, the retry succeeds
    keep = alloc.malloc(70 * MiB)
    assert (alloc.reserved, alloc.num_alloc_retries, alloc.num_ooms) == (70 * MiB, 1, 0)
    # 70 live + 50 > 100 and nothing is cached: after the same retry, out of memory
    with pytest.raises(SimulatedOutOfMemoryError, match="tried to allocate 52428800 B") as error:
        alloc.malloc(50 * MiB)
    assert (alloc.num_alloc_retries, alloc.num_ooms) == (2, 1)
    assert (error.value.allocated, error.value.reserved, error.value.capacity) == (70 * MiB, 70 * MiB, 100 * MiB)
    alloc.free(keep)


def test_release_available_frees_one_oversize_block_first():
    alloc = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:40"), capacity=120 * MiB)
    for handle in [alloc.malloc(50 * MiB), alloc.malloc(60 * MiB)]:
        alloc.free(handle)
    # 30 MiB cannot use the oversize blocks; 110 + 30 > 120. release_available_cached_blocks frees the
    # smallest oversize block >= max(30, 40) = the 50 MiB one, and the first retry (not counted) succeeds.
    alloc.malloc(30 * MiB)
    assert layout(alloc) == [(60, [(60, False)]), (30, [(30, True)])]
    assert (alloc.num_alloc_retries, alloc.num_device_free) == (0, 1)


def test_release_available_frees_oversize_blocks_largest_first():
    alloc = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:40"), capacity=200 * MiB)
    handles = [alloc.malloc(n * MiB) for n in (42, 44, 46)]
    for h in handles:
        alloc.free(h)
    # 120 MiB: no free block is >= 120; 132 + 120 > 200. From the largest down, 46 then 44 are freed
    # (90 < 120, then the 42 too: 132 >= 120), then the first retry fits 120 MiB.
    alloc.malloc(120 * MiB)
    assert layout(alloc) == [(120, [(120, True)])]
    assert alloc.num_device_free == 3 and alloc.num_alloc_retries == 0


def test_memory_fraction_caps_reserved_memory():
    alloc = CachingAllocator(device_total=100 * MiB)
    alloc.set_memory_fraction(0.5)  # allowed = round(0.5 * 100 MiB) = 50 MiB
    alloc.malloc(40 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError):
        alloc.malloc(20 * MiB)  # 40 + 20 > 50, even though the device has room
    assert (alloc.num_alloc_retries, alloc.num_ooms) == (1, 1)
    with pytest.raises(InvalidArgumentError, match="device size"):
        CachingAllocator().set_memory_fraction(0.5)


def test_throw_on_cudamalloc_oom_rejects_without_retrying():
    config = AllocatorConfig.parse("per_process_memory_fraction:0.5,throw_on_cudamalloc_oom:True")
    alloc = CachingAllocator(config, device_total=100 * MiB)
    alloc.set_memory_fraction(1.0)  # lift the fraction limit; the config's rejection at 50 MiB remains
    alloc.malloc(40 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError, match="throw_on_cudamalloc_oom"):
        alloc.malloc(20 * MiB)
    assert (alloc.num_oom_rejections, alloc.num_alloc_retries, alloc.num_ooms) == (1, 0, 0)


def test_garbage_collection_frees_blocks_of_average_age_or_older():
    # device 100 MiB, fraction 0.9 -> allowed 94,371,840 B; threshold 0.5 -> collect above 47,185,920 B
    config = AllocatorConfig.parse("per_process_memory_fraction:0.9,garbage_collection_threshold:0.5")
    alloc = CachingAllocator(config, device_total=100 * MiB)
    for n in (20, 22, 24):  # each malloc is one get_free_block call of the large pool: clock 1, 2, 3
        alloc.free(alloc.malloc(n * MiB))  # freed at clock 1, 2, 3 with nothing reused
    # 26 MiB, clock 4: no block fits; reserved 66 MiB > 45 MiB -> collect 21 MiB. Ages 3, 2, 1 (average 2):
    # the 20 and 22 MiB blocks go (42 MiB >= 21), the 24 MiB one stays; then a new 26 MiB segment.
    alloc.malloc(26 * MiB)
    assert layout(alloc) == [(24, [(24, False)]), (26, [(26, True)])]
    assert alloc.reserved == 50 * MiB and alloc.num_device_free == 2


def test_garbage_collection_needs_a_memory_fraction():
    # torch collects only when a fraction below 1 is set (allowed_memory_maximum has a value)
    alloc = CachingAllocator(AllocatorConfig.parse("garbage_collection_threshold:0.5"), device_total=100 * MiB)
    for n in (20, 22, 24):
        alloc.free(alloc.malloc(n * MiB))
    alloc.malloc(26 * MiB)
    assert alloc.reserved == 92 * MiB and alloc.num_device_free == 0


def test_backend_cudamallocasync_is_not_modelled():
    with pytest.raises(InvalidArgumentError, match="cudaMallocAsync"):
        CachingAllocator(AllocatorConfig.parse("backend:cudaMallocAsync"))
    with pytest.raises(InvalidArgumentError, match="AllocatorConfig"):
        CachingAllocator("expandable_segments:True")


def test_memory_stats_and_snapshot_use_torchs_names():
    alloc = CachingAllocator()
    alloc.malloc(1000)  # 1024 B block in a 2 MiB small segment
    stats = alloc.memory_stats()
    assert stats["allocated_bytes.all.current"] == 1024 and stats["reserved_bytes.all.peak"] == 2 * MiB
    assert stats["requested_bytes.all.current"] == 1000 and stats["segment.all.current"] == 1
    (segment,) = alloc.snapshot()
    assert segment["segment_type"] == "small" and segment["total_size"] == 2 * MiB
    assert segment["blocks"] == [{"size": 1024, "requested_size": 1000, "state": "active_allocated"},
                                 {"size": 2 * MiB - 1024, "requested_size": 0, "state": "inactive"}]
    alloc.reset_peak_stats()
    assert alloc.peak_reserved == 2 * MiB and alloc.peak_requested == 1000
