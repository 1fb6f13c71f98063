"""Blocks freed while another stream still uses them (``record_stream``), as torch's caching allocator treats them
(c10/cuda/CUDACachingAllocator.cpp): ``free`` takes the bytes out of allocated at once, ``insert_events`` keeps the
block out of the cache until ``process_events`` sees its events complete, and ``release_cached_blocks`` waits for
every event first (``synchronize_and_free_events``). Sizes of 20 MiB: a multiple of 2 MiB over 10 MiB, so each
request is a segment of its own size."""

from __future__ import annotations

import pytest

from memprof.anatomy.alloc_audit import AuditedAllocator
from memprof.errors import InvalidArgumentError

MiB = 2**20


def test_an_awaiting_block_leaves_allocated_but_not_for_reuse():
    a = AuditedAllocator()
    h1 = a.malloc(20 * MiB)
    a.free(h1, awaiting=True)
    # allocated drops at once; the block is still active (active_bytes) and reserved
    assert (a.allocated, a.active, a.reserved) == (0, 20 * MiB, 20 * MiB)
    h2 = a.malloc(20 * MiB)  # the awaiting block is not taken: a second segment
    assert (a.allocated, a.reserved, a.peak_active) == (20 * MiB, 40 * MiB, 40 * MiB)
    a.release_awaiting(h1)  # its events completed: cached
    a.free(h2)
    h3 = a.malloc(20 * MiB)  # a cached 20 MiB block serves it: no new segment
    assert (a.allocated, a.reserved) == (20 * MiB, 40 * MiB)
    a.free(h3)


def test_empty_cache_waits_for_the_events_first():
    a = AuditedAllocator()
    a.free(a.malloc(20 * MiB), awaiting=True)
    a.empty_cache()  # synchronize_and_free_events, then the whole free segment goes back to the device
    assert (a.reserved, a.active, a.awaiting_bytes) == (0, 0, 0)


def test_the_out_of_memory_retry_waits_for_the_events_and_fits():
    # 30 MiB of room: the first 20 MiB segment awaits its events; the second request finds no cached block and
    # no room for a new segment (40 > 30), so torch releases its cache, which first waits for the events: the
    # awaiting segment is freed and the retry maps a new one. One retry, 20 MiB reserved.
    a = AuditedAllocator(capacity=30 * MiB)
    a.free(a.malloc(20 * MiB), awaiting=True)
    a.malloc(20 * MiB)
    assert (a.reserved, a.num_alloc_retries, a.awaiting_bytes) == (20 * MiB, 1, 0)


def test_a_neighbour_does_not_merge_with_an_awaiting_block():
    # Two 6 MiB requests split one 20 MiB segment (large pool: requests of 1-10 MiB take 20 MiB segments). The
    # first awaits its events; freeing the second merges it with the free rest (6 + 8 = 14 MiB) but not with the
    # first, so a 20 MiB request finds no 20 MiB free block and maps a second segment: 40 MiB. Once the first's
    # events complete, it merges: the whole first segment is one free 20 MiB block again.
    a = AuditedAllocator()
    h1, h2 = a.malloc(6 * MiB), a.malloc(6 * MiB)
    assert a.reserved == 20 * MiB
    a.free(h1, awaiting=True)
    a.free(h2)
    h3 = a.malloc(20 * MiB)
    assert a.reserved == 40 * MiB
    a.release_awaiting(h1)
    a.free(h3)
    assert sorted(b.size for b in a.blocks() if not b.allocated) == [20 * MiB, 20 * MiB]


def test_releasing_what_does_not_await_is_refused():
    a = AuditedAllocator()
    h = a.malloc(MiB)
    with pytest.raises(InvalidArgumentError, match="not awaiting events"):
        a.release_awaiting(h)
