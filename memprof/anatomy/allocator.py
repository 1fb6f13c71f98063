"""A model of PyTorch's CUDA caching allocator, cuBLAS workspaces and the CUDA context.

Constants and rules from ``c10/cuda/CUDACachingAllocator.cpp`` and
``c10/core/AllocatorConfig.h`` (see ``docs/anatomy.md#cuda-caching-allocator``). The simulator covers the
default configuration: one stream, no ``expandable_segments``, no
``roundup_power2_divisions``, ``max_split_size`` unlimited, and cached blocks
are never released to the device (no ``empty_cache``, no OOM retry).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError

__all__ = [
    "K_MIN_BLOCK_SIZE",
    "K_SMALL_SIZE",
    "K_SMALL_BUFFER",
    "K_MIN_LARGE_ALLOC",
    "K_LARGE_BUFFER",
    "K_ROUND_LARGE",
    "CUBLAS_WORKSPACE_DEFAULT",
    "CUBLAS_WORKSPACE_HOPPER",
    "CUDA_CONTEXT_RANGE",
    "CUDA_CONTEXT_LAZY_BYTES",
    "CUDA_CONTEXT_EAGER_BYTES",
    "round_size",
    "pool_of",
    "segment_size",
    "cublas_workspace_bytes",
    "CachingAllocatorModel",
]

# Allocator constants: c10/cuda/CUDACachingAllocator.cpp; in torch 2.13 they live in c10/core/AllocatorConfig.h.
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes round up to multiples of 512
K_SMALL_SIZE = 1_048_576  # kSmallSize: largest "small" request, 1 MiB
K_SMALL_BUFFER = 2_097_152  # kSmallBuffer: small-pool segment size, 2 MiB
K_MIN_LARGE_ALLOC = 10_485_760  # kMinLargeAlloc: requests below 10 MiB get a kLargeBuffer segment
# kLargeBuffer / AllocatorConfig large_segment_size_ default (20971520), 20 MiB; large_segment_size_mb changes it.
K_LARGE_BUFFER = 20_971_520
K_ROUND_LARGE = 2_097_152  # kRoundLarge: large segments round to 2 MiB

# aten/src/ATen/cuda/CublasHandlePool.cpp: default CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8"
# = 2 x 4096 KiB + 8 x 16 KiB.
CUBLAS_WORKSPACE_DEFAULT = 2 * 4096 * 1024 + 8 * 16 * 1024  # 8,519,680 B
# 32 MiB on Hopper (sm 9.0 in older code; majors 9, 10, 12 in newer code) (aten/src/ATen/cuda/CublasHandlePool.cpp).
CUBLAS_WORKSPACE_HOPPER = 32 * 1024 * 1024  # 33,554,432 B
_CUBLAS_BIG_MAJORS = (9, 10, 12)  # the newer CublasHandlePool.cpp rule

# CUDA context + kernels, per process, outside PyTorch's allocator (docs/anatomy.md#cuda-context):
# 287,047,680 B with CUDA_MODULE_LOADING=LAZY vs 666,632,192 B eager (PyTorch PR #85692);
# 1343 MiB on a V100 with CUDA 11.2, eager (HF docs, "Model training anatomy"); "~300MB" lazy, ">1000MB" before
# 11.7 (ptrblck, PyTorch issues #109888 and #107667).
CUDA_CONTEXT_LAZY_BYTES = 287_047_680
CUDA_CONTEXT_EAGER_BYTES = 666_632_192
#: A per-model budget for the context: 0.3-1.5 GB (GB = 1e9), depending on driver, libraries and lazy loading;
#: derived from the measurements above (docs/anatomy.md#cuda-context).
CUDA_CONTEXT_RANGE: tuple[int, int] = (300_000_000, 1_500_000_000)


def _check_size(nbytes: int) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidArgumentError(f"nbytes must be a non-negative int, got {nbytes!r}")


def round_size(nbytes: int) -> int:
    """``max(512, ceil(n/512)·512)``: the block size the allocator hands out for ``nbytes``."""
    _check_size(nbytes)
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def pool_of(nbytes: int) -> str:
    """``"small"`` if the rounded size is ≤ 1 MiB, else ``"large"``."""
    return "small" if round_size(nbytes) <= K_SMALL_SIZE else "large"


def segment_size(nbytes: int) -> int:
    """Size of the new segment (``cudaMalloc``) made when no cached block fits ``nbytes``.

    ≤ 1 MiB → 2 MiB; < 10 MiB → 20 MiB; otherwise rounded up to 2 MiB.
    """
    size = round_size(nbytes)
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def cublas_workspace_bytes(compute_capability: tuple[int, int]) -> int:
    """Default cuBLAS workspace per (handle, stream): 32 MiB for majors 9/10/12, else 8,519,680 B.

    A ``CUBLAS_WORKSPACE_CONFIG`` environment variable overrides this in torch; it is not read here.
    """
    major = compute_capability[0]
    return CUBLAS_WORKSPACE_HOPPER if major in _CUBLAS_BIG_MAJORS else CUBLAS_WORKSPACE_DEFAULT


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    pool: str
    allocated: bool = False
    requested: int = 0


class CachingAllocatorModel:
    """Simulates allocated/reserved bytes of the CUDA caching allocator.

    ``malloc`` takes the best-fitting (smallest, then lowest address) free block
    of the request's pool, or makes a new segment; blocks split when the rest is
    ≥ 512 B (small pool) or > 1 MiB (large pool); freed blocks merge with free
    neighbours of the same segment and stay cached (reserved never shrinks).
    """

    def __init__(self) -> None:
        self._blocks: list[_Block] = []
        self._handles: dict[int, _Block] = {}
        self._next_handle = 0
        self._next_segment = 0
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0

    @property
    def inactive_split_bytes(self) -> int:
        """Free bytes inside segments that also hold allocated blocks (the allocator's inactive_split)."""
        busy = {b.segment for b in self._blocks if b.allocated}
        return sum(b.size for b in self._blocks if not b.allocated and b.segment in busy)

    def segments(self) -> list[tuple[int, list[tuple[int, bool]]]]:
        """``[(segment_bytes, [(block_bytes, allocated), ...]), ...]`` in address order."""
        out: dict[int, list[_Block]] = {}
        for b in self._blocks:
            out.setdefault(b.segment, []).append(b)
        return [
            (sum(b.size for b in blocks), [(b.size, b.allocated) for b in sorted(blocks, key=lambda b: b.offset)])
            for _, blocks in sorted(out.items())
        ]

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes``; returns a handle for :meth:`free`."""
        size = round_size(nbytes)
        pool = pool_of(nbytes)
        free = [b for b in self._blocks if not b.allocated and b.pool == pool and b.size >= size]
        if free:
            block = min(free, key=lambda b: (b.size, b.segment, b.offset))
        else:
            seg = segment_size(nbytes)
            block = _Block(segment=self._next_segment, offset=0, size=seg, pool=pool)
            self._next_segment += 1
            self._blocks.append(block)
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        split = remaining >= K_MIN_BLOCK_SIZE if pool == "small" else remaining > K_SMALL_SIZE
        if split:
            rest = _Block(segment=block.segment, offset=block.offset + size, size=remaining, pool=pool)
            block.size = size
            self._blocks.append(rest)
        block.allocated = True
        block.requested = nbytes
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._next_handle += 1
        self._handles[self._next_handle] = block
        return self._next_handle

    def free(self, handle: int) -> None:
        """Return a block to the cache, merging it with free neighbours in its segment."""
        block = self._handles.pop(handle, None)
        if block is None:
            raise InvalidArgumentError(f"handle {handle!r} is not allocated (freed twice or never returned by malloc)")
        block.allocated = False
        self.allocated -= block.size
        merged = True
        while merged:
            merged = False
            for other in self._blocks:
                if other is block or other.allocated or other.segment != block.segment:
                    continue
                if other.offset + other.size == block.offset or block.offset + block.size == other.offset:
                    block.offset = min(block.offset, other.offset)
                    block.size += other.size
                    self._blocks.remove(other)
                    merged = True
                    break
