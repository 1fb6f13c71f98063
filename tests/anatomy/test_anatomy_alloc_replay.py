"""replay(): an allocation stream through the caching-allocator model, with peaks, timelines and the first OOM."""

from __future__ import annotations

import pytest

from memprof.anatomy.alloc_config import AllocatorConfig
from memprof.anatomy.alloc_replay import replay
from memprof.anatomy.allocator import CachingAllocator
from memprof.errors import InvalidArgumentError

MiB = 2**20


def test_peaks_and_timeline():
    events = [("alloc", "w", 40_000, 0), ("alloc", "x", 4_000), ("free", "x"), ("alloc", "y", 12 * MiB),
              ("free", "y"), ("empty_cache",), ("free", "w")]
    result = replay(events, timeline=True)
    # w -> 40,448 and x -> 4,096 in one 2 MiB small segment; y: a 12 MiB segment (>= 10 MiB, rounded to
    # 2 MiB); empty_cache gives back the free 12 MiB segment; the small one still holds w
    assert list(result.allocated) == [40_448, 44_544, 40_448, 40_448 + 12 * MiB, 40_448, 40_448, 0]
    assert list(result.reserved) == [2 * MiB, 2 * MiB, 2 * MiB, 14 * MiB, 14 * MiB, 2 * MiB, 2 * MiB]
    assert (result.peak_allocated, result.peak_allocated_at) == (40_448 + 12 * MiB, 3)
    assert (result.peak_reserved, result.peak_reserved_at) == (14 * MiB, 3)
    assert (result.events, result.final_reserved, result.fits) == (7, 2 * MiB, True)
    assert replay(events).allocated is None  # no timeline unless asked


def test_stops_at_the_first_out_of_memory_event():
    events = [("alloc", i, 30 * MiB) for i in range(5)]
    result = replay(events, capacity=100 * MiB)
    # three 30 MiB segments fit in 100 MiB; the fourth fails after the retry (nothing cached to free)
    assert not result.fits and result.events == 4
    assert (result.oom.index, result.oom.key, result.oom.reserved) == (3, 3, 90 * MiB)
    assert (result.num_ooms, result.num_alloc_retries) == (1, 1)
    assert "tried to allocate 31457280 B" in result.oom.message


def test_config_and_an_existing_allocator():
    expandable = AllocatorConfig.parse("expandable_segments:True")
    # 5 MiB in an expandable segment maps one 20 MiB page, where the default makes a 20 MiB segment too
    assert replay([("alloc", "a", 5 * MiB)], expandable, device_total=1024 * MiB).peak_reserved == 20 * MiB
    alloc = CachingAllocator()
    first = alloc.malloc(12 * MiB)
    alloc.free(first)
    # the cached 12 MiB segment of the allocator given serves the replayed request
    assert replay([("alloc", "b", 11 * MiB)], allocator=alloc).final_reserved == 12 * MiB
    with pytest.raises(InvalidArgumentError, match="either allocator= or config"):
        replay([], expandable, allocator=alloc)


@pytest.mark.parametrize("events,message", [
    ([("free", "nobody")], "free of 'nobody', which is not allocated"),
    ([("alloc", "a", 10), ("alloc", "a", 10)], "'a' is allocated twice"),
    ([("resize", "a", 10)], "unknown op 'resize'"),
])
def test_bad_streams_name_the_event(events, message):
    with pytest.raises(InvalidArgumentError, match=message):
        replay(events)


def test_a_long_stream_keeps_the_counters_consistent():
    # 12 layers x (4 saved activations + 10 temporaries) forward, freed in reverse, 20 steps whose sizes
    # grow by 512 B a step, so cached blocks of other layers serve with splits and unsplit slack.
    events, key = [], 0
    for step in range(20):
        saved = []
        for layer in range(12):
            for k in range(4):
                key += 1
                events.append(("alloc", key, (layer + 1) * 3 * MiB + step * 512 + k))
                saved.append(key)
            for k in range(10):
                key += 1
                events.append(("alloc", key, 1000 + 37 * k))
                events.append(("free", key))
        events.extend(("free", k) for k in reversed(saved))
    for cut in (len(events) // 2 + 7, len(events)):
        result = replay(events[:cut])
        blocks = [b for _, segment in result.allocator.segments() for b in segment]
        # the counters are the sums over the segments' blocks
        assert result.final_reserved == sum(size for size, _ in blocks)
        assert result.final_allocated == sum(size for size, used in blocks if used)
    assert result.events == len(events) == 20 * 12 * (4 + 20) + 20 * 48 and result.final_allocated == 0
    # the peak holds at least one step's 48 activations, each rounded up to 512 B
    smallest_step = sum(-(-((layer + 1) * 3 * MiB + k) // 512) * 512 for layer in range(12) for k in range(4))
    assert result.peak_allocated >= smallest_step
