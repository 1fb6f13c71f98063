"""The caching-allocator model where blocks are large (GBs) and their sizes change from step to step (issue 38
item 3): each rule of torch's DeviceCachingAllocator (c10/cuda/CUDACachingAllocator.cpp) that decides what
happens to a multi-GB block, named by its function, on a hand-built stream whose expected figures are worked
out in the comments from the sizes alone. MiB = 2**20, GiB = 2**30.

The loss stream below is the one of a fp32 cross-entropy over a 128,256-token vocabulary (Llama 3's): per step
the bf16 logits L, their fp32 upcast F, log_softmax's output S (saved for backward), F freed; in backward
nll_loss's gradient G1, log_softmax's G2, G1 and S freed, the bf16 gradient G3, then G2, L and G3 freed.
With 2**14 tokens the bf16 logits are 2**14 * 128,256 * 2 B = 501 * 8 MiB = 4008 MiB and the fp32 ones 8016 MiB;
every size is a multiple of 2 MiB, so each new segment is exactly its request (get_allocation_size rounds
requests of 10 MiB and more up to kRoundLarge, 2 MiB).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memprof.anatomy.alloc_config import AllocatorConfig
from memprof.anatomy.alloc_replay import replay
from memprof.anatomy.allocator import CachingAllocator, round_size, segment_size
from memprof.errors import SimulatedOutOfMemoryError

MiB = 2**20
GiB = 2**30
VOCAB = 128_256


def layout(alloc: CachingAllocator) -> list[tuple[float, list[tuple[float, bool]]]]:
    """Segments in MiB: [(segment, [(block, allocated), ...]), ...] in the order they were made."""
    return [(size / MiB, [(b / MiB, used) for b, used in blocks]) for size, blocks in alloc.segments()]


def loss_step(step: int, tokens: int) -> list[tuple[object, ...]]:
    """One step's allocation events of the fp32 loss (see the module docstring), keys unique to the step."""
    bf16 = tokens * VOCAB * 2
    fp32 = 2 * bf16

    def k(name: str) -> str:
        return f"{name}{step}"

    return [("alloc", k("L"), bf16), ("alloc", k("F"), fp32), ("alloc", k("S"), fp32), ("free", k("F")),
            ("alloc", k("G1"), fp32), ("alloc", k("G2"), fp32), ("free", k("G1")), ("free", k("S")),
            ("alloc", k("G3"), bf16), ("free", k("G2")), ("free", k("L")), ("free", k("G3"))]


# Three steps whose token counts change (a packed batch that varies): 16,384, then 12,288, then 20,480 tokens.
# bf16 logits: 4008, 3006 (3 * 501 * 2 MiB), 5010 MiB (5 * 501 * 2 MiB); fp32 twice that: 8016, 6012, 10020 MiB.
STEPS = [(1, 16_384), (2, 12_288), (3, 20_480)]


def loss_stream(steps: list[tuple[int, int]] = STEPS) -> list[tuple[object, ...]]:
    return [event for step, tokens in steps for event in loss_step(step, tokens)]


def test_the_loss_sizes_are_the_arithmetic_of_the_docstring():
    assert [tokens * VOCAB * 2 // MiB for _, tokens in STEPS] == [4008, 3006, 5010]
    assert all(tokens * VOCAB * 2 % (2 * MiB) == 0 for _, tokens in STEPS)


def test_round_size_of_a_multi_gb_request_is_512_b_and_its_segment_2_mib():
    """round_size (kMinBlockSize), get_allocation_size (kRoundLarge) and should_split (kSmallSize)."""
    alloc = CachingAllocator()
    alloc.malloc(3_000_000_001)
    # round_size: ceil(3,000,000,001 / 512) * 512 = 5,859,376 * 512 = 3,000,000,512 (no 2 MiB rounding of the
    # block). get_allocation_size: ceil(3,000,000,512 / 2,097,152) = 1431 pieces of 2 MiB = 3,001,024,512 B.
    # should_split: the rest, 1,024,000 B, is not above kSmallSize (1,048,576): the block keeps it, and torch
    # counts it as allocated (alloc_found_block adds block->size).
    assert (round_size(3_000_000_001), segment_size(3_000_000_001)) == (3_000_000_512, 3_001_024_512)
    assert (alloc.reserved, alloc.allocated, alloc.requested) == (3_001_024_512, 3_001_024_512, 3_000_000_001)
    alloc.malloc(3_001_500_000)
    # round_size: 5,862,305 * 512 = 3,001,500,160; segment: 1432 * 2 MiB = 3,003,121,664; the rest,
    # 1,621,504 B, is above 1 MiB: split off as a free block of the segment (inactive_split_bytes).
    assert alloc.allocated == 3_001_024_512 + 3_001_500_160
    assert alloc.reserved == 3_001_024_512 + 3_003_121_664
    assert alloc.inactive_split_bytes == 1_621_504


def test_roundup_power2_divisions_at_gb_sizes_and_past_64_gib():
    """round_size -> roundup_power2_next_division, with AcceleratorAllocatorConfig::roundup_power2_divisions's
    interval index log2(size) - 20 clamped to the last of the 16 intervals ([32 GiB, ...))."""
    config = AllocatorConfig.parse("roundup_power2_divisions:[1024:2,>:8]")  # intervals 0-10: 2, 11-15: 8
    # 1.5 GiB + 1 B lies in [1 GiB, 2 GiB), interval 10, 2 divisions: steps of 512 MiB -> 2 GiB
    assert round_size(3 * GiB // 2 + 1, config) == 2 * GiB
    # 5 GiB + 1 B in [4 GiB, 8 GiB), interval 12, 8 divisions: steps of 512 MiB -> 5.5 GiB
    assert round_size(5 * GiB + 1, config) == 5632 * MiB
    # 100 GiB: log2 = 36 -> index 16, clamped to 15 (8 divisions); floor 64 GiB, steps of 8 GiB -> 104 GiB
    assert round_size(100 * GiB, config) == 104 * GiB
    # a power of two, or a size on a step, is left as it is
    assert (round_size(8 * GiB, config), round_size(6 * GiB, config)) == (8 * GiB, 6 * GiB)
    alloc = CachingAllocator(config)
    alloc.malloc(5 * GiB + 1)  # the segment is the rounded block: 5.5 GiB (already a multiple of 2 MiB)
    assert (alloc.reserved, alloc.allocated, alloc.requested) == (5632 * MiB, 5632 * MiB, 5 * GiB + 1)


def test_a_smaller_request_splits_a_cached_multi_gb_block_and_the_larger_one_needs_a_new_segment():
    """get_free_block (best fit, no max_split_size) and should_split: with sizes that change, a cached 4 GiB
    block serves 2.5 GiB and keeps 1.5 GiB free in its segment, so the next 4 GiB request makes a segment."""
    alloc = CachingAllocator()
    alloc.free(alloc.malloc(4 * GiB))
    h = alloc.malloc(2560 * MiB)  # the cached 4 GiB block, split: 2560 + 1536 MiB (1536 MiB > 1 MiB)
    g = alloc.malloc(4 * GiB)  # no free block of 4 GiB (only 1536 MiB): a second 4 GiB segment
    assert layout(alloc) == [(4096, [(2560, True), (1536, False)]), (4096, [(4096, True)])]
    assert (alloc.allocated, alloc.reserved) == (6656 * MiB, 8 * GiB)
    alloc.free(h)  # 2560 + 1536 merge: 4 GiB free again
    alloc.free(g)
    alloc.malloc(4608 * MiB)  # 4.5 GiB: no cached block is that large -> a third segment
    assert alloc.reserved == (4096 + 4096 + 4608) * MiB and alloc.peak_allocated == 6656 * MiB


def test_the_loss_stream_of_changing_sizes_replayed_without_a_limit():
    """The three-step loss stream through replay(), default config, unlimited device.

    Step 1 (L 4008, F/S/G1/G2 8016, G3 4008 MiB): L, F, S make segments A (4008), B, C (8016); F freed; G1 takes
    B exactly; G2 makes D (8016). G3 (4008) takes the smallest free block >= 4008: B and C tie at 8016 and B, the
    older segment (registration_counter), serves, split 4008 + 4008; everything is freed and merges back.
    Reserved 4008 + 3 * 8016 = 28,056 MiB, reached at G2 with every segment in use: peak allocated = reserved.
    Step 2 (L 3006, fp32 6012): every request finds a cached block at least as large and splits it (A for L,
    B for F, C for S, B again for G1 once F is freed, D for G2, B for G3): no new segment, reserved 28,056 MiB.
    Step 3 (L 5010, fp32 10,020): L splits B; no cached block holds 10,020 MiB, so F, S and G2 make segments
    E, F', G (G1 reuses E once F is freed): 28,056 + 3 * 10,020 = 58,116 MiB reserved. Allocated peaks at G2:
    L + S + G1 + G2 = 5010 + 3 * 10,020 = 35,070 MiB.
    """
    result = replay(loss_stream())
    assert result.fits and result.num_alloc_retries == 0
    assert result.peak_reserved == 58_116 * MiB and result.final_reserved == 58_116 * MiB
    assert result.peak_allocated == 35_070 * MiB and result.final_allocated == 0
    assert [size / MiB for size, _ in result.allocator.segments()] == [4008, 8016, 8016, 8016, 10020, 10020, 10020]
    # Step 1 alone: reserved is its peak allocated, 28,056 MiB
    first = replay(loss_stream(STEPS[:1]))
    assert first.peak_reserved == first.peak_allocated == 28_056 * MiB


def test_the_loss_stream_under_a_capacity_frees_the_cache_and_retries():
    """malloc's ladder when cudaMalloc fails: release_available_cached_blocks (nothing without max_split_size),
    then release_cached_blocks (every whole free segment) and a retry counted in num_alloc_retries.

    Capacity 40,000 MiB. Steps 1 and 2 as above (28,056 MiB). Step 3: L splits B; F makes E: 38,076 MiB. S
    (10,020) would take 48,096 > 40,000: cudaMalloc fails; release_cached_blocks frees the free unsplit
    segments A (4008), C and D (8016 each): 38,076 - 20,040 = 18,036 MiB, and the retry makes S's segment:
    28,056. F is freed, G1 takes E, G2 makes a segment: 38,076 MiB again, the peak. G3 (5010) splits E's
    segment (the older of the two free 10,020 MiB blocks).
    """
    result = replay(loss_stream(), capacity=40_000 * MiB)
    assert result.fits
    assert (result.num_alloc_retries, result.allocator.num_device_free) == (1, 3)
    assert result.peak_reserved == 38_076 * MiB and result.final_reserved == 38_076 * MiB
    assert result.peak_allocated == 35_070 * MiB
    assert [size / MiB for size, _ in result.allocator.segments()] == [8016, 10020, 10020, 10020]


def test_the_loss_stream_under_a_capacity_it_cannot_fit_is_out_of_memory_with_the_cache_freed():
    """When even the retry fails, torch raises OutOfMemoryError; what stays reserved is split segments only.

    Capacity 30,000 MiB: step 1 needs 28,056. Step 3: L splits B (5010 + 3006 free); F (10,020) would take
    38,076: release_cached_blocks frees A, C, D (20,040) -> 8016, and the retry makes F's segment: 18,036.
    S (10,020): 28,056 <= 30,000, a segment. G1 reuses F's segment once F is freed. G2 (10,020): 38,076 >
    30,000; nothing free is whole (B is split around L), so the retry fails: out of memory at G2, with
    L + S + G1 = 25,050 MiB allocated and 28,056 MiB reserved.
    """
    result = replay(loss_stream(), capacity=30_000 * MiB)
    assert not result.fits and result.oom is not None
    assert result.oom.key == "G23" and result.oom.requested == 10_020 * MiB
    assert (result.oom.allocated, result.oom.reserved) == (25_050 * MiB, 28_056 * MiB)
    assert (result.num_alloc_retries, result.num_ooms) == (2, 1)


def test_the_loss_stream_with_max_split_size_keeps_each_size_in_its_own_segments():
    """max_split_size_mb:1024: every loss block is oversize. get_free_block refuses a block >= 1 GiB to a
    request it exceeds by max_non_split_rounding (default large_segment_size, 20 MiB) or more; should_split
    never splits it; the oversize_allocations / oversize_segments stats count them.

    Step 1: A (L 4008), B, C (F, S 8016); G1 takes B exactly; D (G2 8016). G3 (4008): the smallest free block
    >= 4008 is B (8016), and 8016 >= 4008 + 20: refused, a new 4008 MiB segment H (torch looks at that one
    block only). Reserved 4008 * 2 + 8016 * 3 = 32,064 MiB.
    Step 2 (3006 / 6012): the smallest cached block above each request exceeds it by far more than 20 MiB, so
    L, F, S, G2 and G3 make segments (G1 reuses F's, freed just before): 3006 * 2 + 6012 * 3 = 24,048 more,
    56,112 MiB reserved, against a peak allocated of 28,056 MiB (step 1's).
    """
    config = AllocatorConfig.parse("max_split_size_mb:1024")
    result = replay(loss_stream(STEPS[:2]), config)
    assert result.peak_reserved == 56_112 * MiB and result.peak_allocated == 28_056 * MiB
    alloc = result.allocator
    assert sorted(size / MiB for size, _ in alloc.segments()) == [3006] * 2 + [4008] * 2 + [6012] * 3 + [8016] * 3
    assert alloc.inactive_split_bytes == 0  # no oversize block was ever split
    assert (alloc.oversize_allocations, alloc.oversize_segments) == (0, 10)  # all freed; 10 segments >= 1 GiB
    # Within max_non_split_rounding a cached oversize block serves whole: 4008 MiB cached, 3990 MiB asked
    # (4008 < 3990 + 20): the block is handed out unsplit and allocated counts all 4008 MiB.
    near = CachingAllocator(config)
    near.free(near.malloc(4008 * MiB))
    near.malloc(3990 * MiB)
    assert (near.reserved, near.allocated, near.oversize_allocations) == (4008 * MiB, 4008 * MiB, 1)
    # 3988 MiB: 4008 >= 3988 + 20, refused: a second segment
    near.malloc(3988 * MiB)
    assert near.reserved == (4008 + 3988) * MiB


def test_max_non_split_rounding_widens_what_an_oversize_block_may_serve():
    """get_free_block's second oversize check reads max_non_split_rounding_mb: with 1024, the cached 4008 MiB
    block serves 3006 MiB (4008 < 3006 + 1024), unsplit."""
    config = AllocatorConfig.parse("max_split_size_mb:1024,max_non_split_rounding_mb:1024")
    alloc = CachingAllocator(config)
    alloc.free(alloc.malloc(4008 * MiB))
    alloc.malloc(3006 * MiB)
    assert (alloc.reserved, alloc.allocated, alloc.requested) == (4008 * MiB, 4008 * MiB, 3006 * MiB)
    # 2984 MiB: 4008 >= 2984 + 1024 = 4008 (the check is >=): refused even at equality
    alloc.malloc(2984 * MiB)
    assert alloc.reserved == (4008 + 2984) * MiB


def test_release_available_cached_blocks_frees_oversize_gb_blocks_smallest_covering_then_largest_down():
    """release_available_cached_blocks (only with max_split_size): the smallest free oversize block of the
    stream that covers max(request, max_split_size) is freed, else oversize blocks from the largest down until
    the request is covered; the retry after it is not counted in num_alloc_retries."""
    config = AllocatorConfig.parse("max_split_size_mb:1024")
    alloc = CachingAllocator(config, capacity=16 * GiB)
    for handle in [alloc.malloc(n * GiB) for n in (3, 4, 6)]:
        alloc.free(handle)
    # 5 GiB: the cached 6 GiB block is refused (6 GiB >= 5 GiB + 20 MiB); 13 + 5 > 16 GiB, cudaMalloc fails.
    # The smallest free block >= 5 GiB is the 6 GiB one: freed (13 -> 7 GiB), the retry makes 5 GiB: 12 GiB.
    alloc.malloc(5 * GiB)
    assert layout(alloc) == [(3072, [(3072, False)]), (4096, [(4096, False)]), (5120, [(5120, True)])]
    assert (alloc.num_alloc_retries, alloc.num_device_free) == (0, 1)
    # 10 GiB: 12 + 10 > 16; no free block >= 10 GiB, so from the largest down: 4 GiB then 3 GiB are freed,
    # 7 < 10 and no oversize block is left: it reports failure, but the two are gone all the same (5 GiB
    # reserved). release_cached_blocks has nothing more to free, and the counted retry fits: 5 + 10 = 15 GiB.
    alloc.malloc(10 * GiB)
    assert (alloc.reserved, alloc.num_device_free, alloc.num_alloc_retries) == (15 * GiB, 3, 1)
    # 2 GiB more: 17 > 16 and nothing is cached: both retries fail, out of memory
    with pytest.raises(SimulatedOutOfMemoryError):
        alloc.malloc(2 * GiB)
    assert (alloc.reserved, alloc.num_alloc_retries, alloc.num_ooms) == (15 * GiB, 2, 1)


def test_garbage_collection_frees_old_gb_blocks_before_a_new_segment():
    """garbage_collect_cached_blocks (garbage_collection_threshold, only under a memory fraction): before a new
    segment, when reserved passes threshold * allowed, unsplit large blocks at least as old as the average
    (in get_free_block calls) are freed.

    Device 80 GiB, fraction 0.5: allowed = 40 GiB; threshold 0.5: collect above 20 GiB. Blocks of 8, 9 and
    10 GiB freed at get_free_block clocks 1, 2, 3 (27 GiB reserved). 11 GiB at clock 4: no cached block fits;
    27 > 20 -> target 7 GiB; ages 3, 2, 1, average 2: the 8 and 9 GiB blocks go (17 GiB >= 7), the 10 GiB
    stays; the new 11 GiB segment makes 21 GiB.
    """
    config = AllocatorConfig.parse("per_process_memory_fraction:0.5,garbage_collection_threshold:0.5")
    alloc = CachingAllocator(config, device_total=80 * GiB)
    for n in (8, 9, 10):
        alloc.free(alloc.malloc(n * GiB))
    alloc.malloc(11 * GiB)
    assert layout(alloc) == [(10240, [(10240, False)]), (11264, [(11264, True)])]
    assert (alloc.reserved, alloc.num_device_free) == (21 * GiB, 2)


def test_expandable_segments_map_20_mib_pages_for_gb_requests_of_changing_size():
    """Expandable segments (find_expandable_block, map_block, unmap_block): one segment per stream and pool,
    pages of large_segment_size (20 MiB) in the large pool, every remainder of 512 B or more split.

    A 4 GiB (4096 MiB) request maps ceil(4096 / 20) = 205 pages = 4100 MiB; the block splits 4096 + 4. A 2.5
    GiB (2560 MiB) request: no free block is that large, so the free 4 MiB tail and the unmapped range behind
    it serve; 2556 MiB more are needed, pages 205 to ceil((4100 + 2556) / 20) = 333: 128 pages = 2560 MiB;
    the merged 2564 MiB block splits 2560 + 4. Reserved 4100 + 2560 = 6660 MiB.
    """
    alloc = CachingAllocator(AllocatorConfig.parse("expandable_segments:True"), device_total=80 * GiB)
    a = alloc.malloc(4 * GiB)
    assert alloc.reserved == 4100 * MiB and alloc.allocated == 4096 * MiB
    alloc.malloc(2560 * MiB)
    assert alloc.reserved == 6660 * MiB
    assert layout(alloc) == [(6660, [(4096, True), (2560, True), (4, False)])]
    alloc.free(a)
    # 4.5 GiB (4608 MiB): the free 4096 MiB head is too small and fixed in place (b follows it); the tail (4 MiB)
    # plus unmapped space serves: 4604 MiB more, pages 333 to ceil((6660 + 4604) / 20) = 564: 231 pages =
    # 4620 MiB; reserved 11,280 MiB; the 4624 MiB block splits 4608 + 16. Live 2560 + 4608 = 7168 MiB.
    alloc.malloc(4608 * MiB)
    assert alloc.reserved == 11_280 * MiB and alloc.allocated == 7168 * MiB
    # empty_cache unmaps the pages wholly inside the free 4096 MiB head: pages 0-203 (204 * 20 = 4080 MiB);
    # page 204 (4080-4100 MiB) also holds the start of the 2560 MiB block and stays mapped.
    alloc.empty_cache()
    assert alloc.reserved == (11_280 - 4080) * MiB



def test_the_loss_stream_with_expandable_segments_reserves_its_peak_in_20_mib_pages():
    """The same three steps with expandable_segments:True (find_expandable_block, map_block; get_free_block's
    best fit by the size a block can grow to): one segment, mapped in 20 MiB pages, every rest split.

    Step 1: L (4008) maps 201 pages (4020 MiB), split 4008 + 12; F (8016): the free 12 MiB and the unmapped range
    behind it, 8004 more -> pages 201-601 (8020 MiB), split 8016 + 16; S (8016): 16 + 8000 more, exactly 400
    pages (8000 MiB), no rest; F freed; G1 takes F's 8016 MiB exactly; G2 maps 401 pages (8020 MiB) past S, split
    8016 + 4. Mapped 4020 + 8020 + 8000 + 8020 = 28,060 MiB (the 28,056 of the segments above, rounded to the
    page), 4 maps. Every block freed, the whole range is one free block.
    Step 2 (3006 / 6012) is laid from address 0 in that block: L, F, S, G1 (in F's freed place), G2 after S;
    G3 (3006): the free 7018 MiB tail could grow into the unmapped range, so best fit counts it as larger than
    the 12,024 MiB freed by G1 and S, which serves; no page is mapped.
    Step 3 (5010 / 10,020): L, F, S from address 0 leave a 3010 MiB tail; G1 takes F's place; G2 needs 7010 MiB
    past the tail: pages 1403-1753 (7020 MiB). Reserved 28,060 + 7020 = 35,080 MiB: the peak allocated, 35,070,
    rounded to the page, where one segment per size above reserved 58,116 MiB.
    """
    config = AllocatorConfig.parse("expandable_segments:True")
    h200 = 141 * 10**9  # the address range, 9/8 of the device (158.6 GB), holds the whole stream in one segment
    first = replay(loss_stream(STEPS[:1]), config, device_total=h200)
    assert (first.peak_reserved, first.allocator.num_device_alloc) == (28_060 * MiB, 4)
    two = replay(loss_stream(STEPS[:2]), config, device_total=h200)
    assert (two.peak_reserved, two.allocator.num_device_alloc) == (28_060 * MiB, 4)
    result = replay(loss_stream(), config, device_total=h200)
    assert (result.peak_reserved, result.peak_allocated) == (35_080 * MiB, 35_070 * MiB)
    assert result.allocator.num_device_alloc == 5 and len(result.allocator.segments()) == 1

def test_oversize_stats_keep_their_peaks_and_max_split_size_as_torch_reports_them():
    """DeviceStats: oversize_allocations and oversize_segments are Stats (current and peak, increase_stat in
    alloc_found_block / alloc_block, decrease_stat in free / release_block, reset_peak_stat in resetPeakStats);
    max_split_size is static_cast<int64_t>(max_split_size()), so torch reports -1 for its SIZE_MAX default.

    max_split_size_mb:1024: two oversize blocks (4008 and 3006 MiB) live at once, then both freed: current 0,
    peak 2, for allocations and segments alike. A third (5010 MiB) after resetting the peaks: peak 1 for the
    allocations; the segments, 3 now, peak at 3.
    """
    alloc = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:1024"))
    a, b = alloc.malloc(4008 * MiB), alloc.malloc(3006 * MiB)
    alloc.free(a)
    alloc.free(b)
    stats = alloc.memory_stats()
    assert stats["max_split_size"] == 1024 * MiB
    assert (stats["oversize_allocations.current"], stats["oversize_allocations.peak"]) == (0, 2)
    assert (stats["oversize_segments.current"], stats["oversize_segments.peak"]) == (2, 2)
    alloc.reset_peak_stats()
    alloc.malloc(5010 * MiB)
    stats = alloc.memory_stats()
    assert (stats["oversize_allocations.current"], stats["oversize_allocations.peak"]) == (1, 1)
    assert (stats["oversize_segments.current"], stats["oversize_segments.peak"]) == (3, 3)
    # release_block lowers the current count, never the peak: empty_cache frees the two free segments
    alloc.empty_cache()
    stats = alloc.memory_stats()
    assert (stats["oversize_segments.current"], stats["oversize_segments.peak"]) == (1, 3)
    default = CachingAllocator().memory_stats()
    assert default["max_split_size"] == -1  # SIZE_MAX as int64_t
    assert default["oversize_allocations.peak"] == default["oversize_segments.peak"] == 0


# Streams of multi-GB blocks of changing size (and a few small ones), keys 0-7 reused once freed.
_sizes = st.one_of(st.integers(1, 4 * MiB), st.integers(1 * GiB, 9 * GiB))
_ops = st.lists(st.tuples(st.booleans(), st.integers(0, 7), _sizes), min_size=1, max_size=60)


def _events(ops: list[tuple[bool, int, int]]) -> list[tuple[object, ...]]:
    live: set[int] = set()
    out: list[tuple[object, ...]] = []
    for make, key, size in ops:
        if make and key not in live:
            live.add(key)
            out.append(("alloc", key, size))
        elif not make and key in live:
            live.discard(key)
            out.append(("free", key))
    return out


@settings(max_examples=150, deadline=None)
@given(ops=_ops, config=st.sampled_from(["", "max_split_size_mb:1024", "expandable_segments:True",
                                          "roundup_power2_divisions:4"]),
       capacity=st.integers(1, 40).map(lambda n: n * GiB))
def test_peak_reserved_under_a_capacity_is_at_most_the_capacity_and_the_unlimited_peak(ops, config, capacity):
    """The bound docs/anatomy.md states for the one device term of these rules, the capacity left to cudaMalloc
    (the device less the CUDA context and libraries): a replay under capacity C reserves at most
    min(C, the peak reserved without a capacity), since until its first failed cudaMalloc it is the unlimited
    replay, and after it reserved never passes C. Where C is at least the unlimited peak the two are the same."""
    events = _events(ops)
    conf = AllocatorConfig.parse(config)
    unlimited = replay(events, conf, device_total=144 * GiB)
    capped = replay(events, conf, capacity=capacity, device_total=144 * GiB)
    assert capped.peak_reserved <= min(capacity, unlimited.peak_reserved)
    if capacity >= unlimited.peak_reserved:
        assert (capped.peak_reserved, capped.peak_allocated, capped.fits) == \
            (unlimited.peak_reserved, unlimited.peak_allocated, True)
