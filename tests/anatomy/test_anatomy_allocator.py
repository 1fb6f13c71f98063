"""CUDA caching-allocator model vs. the snapshot oracle (discuss.pytorch.org, "unexpected 8519680B memory
allocation") and the constants of c10/cuda/CUDACachingAllocator.cpp; see docs/anatomy.md#cuda-caching-allocator."""

from __future__ import annotations

import pytest

from memprof.anatomy.allocator import (
    CUDA_CONTEXT_EAGER_BYTES,
    CUDA_CONTEXT_LAZY_BYTES,
    CUDA_CONTEXT_RANGE,
    CachingAllocator,
    cublas_workspace_bytes,
    pool_of,
    round_size,
    segment_size,
)
from memprof.errors import InvalidArgumentError

MiB = 2**20


@pytest.mark.parametrize(
    "n,rounded",
    [(0, 512), (1, 512), (40, 512), (512, 512), (513, 1024), (4_000, 4_096), (40_000, 40_448), (8_519_680, 8_519_680)],
)
def test_round_size(n, rounded):
    # ceil(40,000 / 512) = 79 blocks -> 79 * 512 = 40,448; 4,000 -> 8 * 512 = 4,096
    assert round_size(n) == rounded


def test_pools_and_segments():
    assert pool_of(MiB) == "small" and pool_of(MiB + 1) == "large"
    assert segment_size(40_000) == 2 * MiB  # small requests get a 2 MiB segment
    assert segment_size(8_519_680) == 20 * MiB  # < 10 MiB -> 20 MiB segment
    assert segment_size(10 * MiB) == 10 * MiB  # >= 10 MiB -> rounded to 2 MiB
    assert segment_size(11 * MiB) == 12 * MiB
    with pytest.raises(InvalidArgumentError):
        round_size(-1)


def test_snapshot_oracle():
    alloc = CachingAllocator()
    w = alloc.malloc(40_000)
    b = alloc.malloc(40)
    x = alloc.malloc(4_000)
    # W -> 40,448, b -> 512, X -> 4,096, all in one 2,097,152 B small segment (rest 2,052,096 free)
    assert alloc.segments() == [(2_097_152, [(40_448, True), (512, True), (4_096, True), (2_097_152 - 45_056, False)])]
    ws = alloc.malloc(8_519_680)
    # the cuBLAS workspace: a 20,971,520 B segment with the 8,519,680 B block and 12,451,840 B inactive
    assert alloc.segments()[1] == (20_971_520, [(8_519_680, True), (12_451_840, False)])
    assert alloc.reserved == 2_097_152 + 20_971_520
    assert alloc.allocated == 40_448 + 512 + 4_096 + 8_519_680
    assert alloc.inactive_split_bytes == 2_052_096 + 12_451_840
    for h in (w, b, x, ws):
        alloc.free(h)
    assert alloc.allocated == 0 and alloc.reserved == 2_097_152 + 20_971_520  # nothing returned to the device
    assert alloc.peak_allocated == 8_564_736


def test_reuse_split_rules_and_best_fit():
    alloc = CachingAllocator()
    big = alloc.malloc(12 * MiB)  # a 12 MiB segment, exact fit
    alloc.free(big)
    again = alloc.malloc(11 * MiB + 600 * 1024)  # rest 424 KiB <= 1 MiB: large pool does not split
    assert alloc.reserved == 12 * MiB and alloc.allocated == 12 * MiB
    alloc.free(again)
    smaller = alloc.malloc(10 * MiB)  # rest 2 MiB > 1 MiB: split, 2 MiB stays cached
    assert alloc.allocated == 10 * MiB and alloc.segments() == [(12 * MiB, [(10 * MiB, True), (2 * MiB, False)])]
    alloc.free(smaller)
    # small pool: best fit among free small blocks, split when the remainder >= 512
    a = alloc.malloc(1_000)
    bb = alloc.malloc(3_000)
    alloc.malloc(512)
    alloc.free(a)
    alloc.free(bb)  # merges with a: one free 4,096 block before the 512 one
    c = alloc.malloc(600)
    assert alloc.segments()[1][1][0] == (1_024, True)
    with pytest.raises(InvalidArgumentError):
        alloc.free(a)
    alloc.free(c)
    assert alloc.peak_reserved == 12 * MiB + 2 * MiB


@pytest.mark.parametrize(
    "cc,expected", [((7, 0), 8_519_680), ((8, 0), 8_519_680), ((8, 9), 8_519_680), ((9, 0), 33_554_432), ((10, 0), 33_554_432), ((12, 0), 33_554_432)]
)
def test_cublas_workspace(cc, expected):
    # ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB = 8,519,680 B; Hopper and newer majors 9/10/12: 32 MiB
    assert cublas_workspace_bytes(cc) == expected


def test_context_constants():
    low, high = CUDA_CONTEXT_RANGE
    assert (low, high) == (300_000_000, 1_500_000_000)
    # the lazy-loading measurement (287 MB) sits at the low end; eager (667 MB) and HF's 1343 MiB inside/above
    assert CUDA_CONTEXT_LAZY_BYTES < low < CUDA_CONTEXT_EAGER_BYTES < 1343 * MiB < high


def test_power2_rounding():
    from memprof.anatomy.alloc_config import AllocatorConfig
    from memprof.anatomy.allocator import _power2_division

    # roundup_power2_next_division's own example: 1200 between 1024 and 2048 in 4 steps of 256 -> 1280
    assert _power2_division(1200, 4) == 1280
    four = AllocatorConfig(roundup_power2_divisions=(4,) * 16)
    # round_size only uses the divisions above 512 * divisions = 2048 B: 1200 -> ceil(1200/512)*512 = 1536
    assert round_size(1200, four) == 1536
    # 5000: steps of 4096/4 = 1024 above 4096 -> 5120 (plain rounding would give 5120 too); 9000 -> 10240
    assert (round_size(5000, four), round_size(9000, four)) == (5120, 10240)
    # a power of two stays; 1.1 GiB with 2 divisions rounds to 1.5 GiB (steps of 512 MiB above 1 GiB)
    two = AllocatorConfig(roundup_power2_divisions=(2,) * 16)
    assert round_size(2**30, two) == 2**30 and round_size(1_181_116_006, two) == 1536 * MiB
    # 8 divisions between 8 and 16 MiB: steps of 1 MiB, 9.2 MiB -> 10 MiB, and so a 10 MiB segment
    eight = AllocatorConfig(roundup_power2_divisions=(8,) * 16)
    assert round_size(9_646_899, eight) == 10 * MiB and segment_size(9_646_899, eight) == 10 * MiB


def test_large_segment_size_changes_the_mid_size_segments():
    from memprof.anatomy.alloc_config import AllocatorConfig

    config = AllocatorConfig.parse("large_segment_size_mb:64")
    # requests between 1 and 10 MiB get large_segment_size; 10 MiB and above still round to 2 MiB
    assert segment_size(3 * MiB, config) == 64 * MiB and segment_size(11 * MiB, config) == 12 * MiB
    assert pool_of(MiB, config) == "small"


def test_zero_byte_request_takes_no_block():
    alloc = CachingAllocator()
    handle = alloc.malloc(0)
    assert (alloc.allocated, alloc.reserved, alloc.segments()) == (0, 0, [])
    alloc.free(handle)
    with pytest.raises(InvalidArgumentError):
        alloc.free(handle)
    with pytest.raises(InvalidArgumentError, match="non-negative int"):
        alloc.malloc(-1)
    with pytest.raises(InvalidArgumentError, match="stream"):
        alloc.malloc(10, stream="default")


def test_the_model_modules_need_no_torch():
    # pure Python: none of the allocator, config, replay, GPU or outside-torch modules imports torch
    import ast
    import pathlib

    import memprof.anatomy as anatomy

    folder = pathlib.Path(anatomy.__file__).parent
    names = ["allocator", "alloc_config", "alloc_blocks", "alloc_expandable", "alloc_release", "alloc_segments",
             "alloc_snapshot", "alloc_replay", "gpus", "outside"]
    imported = set()
    for name in names:
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                imported.add(node.module.split(".")[0])
    assert "torch" not in imported and imported <= {"__future__", "bisect", "re", "collections", "dataclasses", "array",
                                                    "os", "typing"}
