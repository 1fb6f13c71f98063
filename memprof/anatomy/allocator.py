"""A model of torch 2.13's CUDA caching allocator, in pure Python (no torch needed).

``CachingAllocator`` follows ``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp`` rule by
rule (each method names the function it follows): rounding (with ``roundup_power2_divisions``), the small
and large pools per stream, segment sizes, best fit, splitting, ``max_split_size_mb``, merging of freed
neighbours, ``empty_cache``, the free-and-retry before an out-of-memory error, the memory fraction,
``garbage_collection_threshold`` and ``expandable_segments``. What it leaves out is listed in
``docs/anatomy.md#cuda-caching-allocator``: cross-stream use (``record_stream`` events), CUDA-graph private
pools, ``MemPool``, IPC, and the driver's own placement of segments (addresses are synthetic and only
order blocks inside a segment).
"""

from __future__ import annotations

from bisect import bisect_left, insort

from ..errors import InvalidArgumentError, is_interrupt
from .alloc_blocks import AddressSpace, Block, BlockPools
from .alloc_fit import FitRules, get_free_block
from .alloc_config import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorConfig,
)
from .alloc_events import await_events, release_awaiting
from .alloc_release import release_cached
from .alloc_segments import allocation_size, new_block
from .alloc_snapshot import SnapshotSegment, inactive_split_bytes, memory_stats, segments, snapshot
from .outside import (
    CUBLAS_WORKSPACE_DEFAULT,
    CUBLAS_WORKSPACE_HOPPER,
    CUDA_CONTEXT_EAGER_BYTES,
    CUDA_CONTEXT_LAZY_BYTES,
    CUDA_CONTEXT_RANGE,
    cublas_workspace_bytes,
)

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
    "AllocatorConfig",
    "round_size",
    "pool_of",
    "segment_size",
    "cublas_workspace_bytes",
    "CachingAllocator",
]

_DEFAULT = AllocatorConfig()


def _check_size(nbytes: int) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidArgumentError(f"nbytes must be a non-negative int, got {nbytes!r}")


def _power2_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: round up to the next of ``divisions`` equal steps between the
    powers of two around ``size`` (1200 with 4 divisions: steps 1024, 1280, 1536, 1792 -> 1280)."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def round_size(nbytes: int, config: AllocatorConfig | None = None) -> int:
    """``DeviceCachingAllocator::round_size``: the block size torch hands out for ``nbytes``.

    ``max(512, ceil(n / 512) * 512)``; with ``roundup_power2_divisions`` of d > 1 for the size's interval
    and n > 512 * d, the next of d equal steps between powers of two instead.
    """
    _check_size(nbytes)
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = (config or _DEFAULT).divisions_for(nbytes)
    if divisions > 1 and nbytes > K_MIN_BLOCK_SIZE * divisions:
        return _power2_division(nbytes, divisions)
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def pool_of(nbytes: int, config: AllocatorConfig | None = None) -> str:
    """``get_pool``: ``"small"`` if the rounded size is <= 1 MiB (``kSmallSize``), else ``"large"``."""
    return "small" if round_size(nbytes, config) <= K_SMALL_SIZE else "large"


def segment_size(nbytes: int, config: AllocatorConfig | None = None) -> int:
    """``get_allocation_size``: the ``cudaMalloc`` made when no cached block fits ``nbytes``.

    <= 1 MiB -> 2 MiB; < 10 MiB -> ``large_segment_size`` (20 MiB); otherwise rounded up to 2 MiB.
    """
    config = config or _DEFAULT
    return allocation_size(round_size(nbytes, config), config.large_segment_size)


class CachingAllocator:
    """The caching allocator of one device, replaying ``malloc``/``free`` byte for byte.

    ``capacity`` is what ``cudaMalloc`` can hand this process in total (the device's free memory once the
    CUDA context and libraries are loaded); ``None`` means unlimited. ``device_total`` is the device's
    ``totalGlobalMem`` (memory fraction, ``throw_on_cudamalloc_oom``, the address range of an expandable
    segment); it defaults to ``capacity``. Counters follow ``torch.cuda.memory_stats``: ``allocated``,
    ``reserved``, ``active``, ``requested`` and their ``peak_*``, ``num_alloc_retries``, ``num_ooms``.
    A request that fails after torch's frees and retries raises
    :class:`~memprof.errors.SimulatedOutOfMemoryError`.

    The allocator holds the state; ``malloc`` and ``free``, the hot path of a replay, are written out here. Its
    parts are functions of the allocator, each declaring as a Protocol what it reads and changes: the cache miss
    (:mod:`.alloc_segments`), giving memory back (:mod:`.alloc_release`), expandable segments
    (:mod:`.alloc_expandable`) and torch's views (:mod:`.alloc_snapshot`). ``pools`` holds the free and unmapped
    blocks (:class:`~memprof.anatomy.alloc_blocks.BlockPools`), ``space`` where new segments go.
    """

    def __init__(self, config: AllocatorConfig | None = None, capacity: int | None = None,
                 device_total: int | None = None) -> None:
        config = AllocatorConfig() if config is None else config
        if not isinstance(config, AllocatorConfig):
            raise InvalidArgumentError(f"config must be an AllocatorConfig (AllocatorConfig.parse(...)), got "
                                       f"{type(config).__name__}")
        if config.backend != "native":
            raise InvalidArgumentError("backend:cudaMallocAsync hands memory to the driver's own pool, which memprof "
                                       "does not model; drop backend:cudaMallocAsync to predict the native allocator")
        for name, value in (("capacity", capacity), ("device_total", device_total)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise InvalidArgumentError(f"{name} must be a positive int of bytes or None, got {value!r}")
        self.config = config
        self.capacity = capacity
        self.device_total = device_total if device_total is not None else capacity
        self.pools = BlockPools()
        self.space = AddressSpace()
        self.allocated = self.reserved = self.requested = 0
        self.peak_allocated = self.peak_reserved = self.peak_requested = 0
        self.num_alloc_retries = self.num_ooms = self.num_oom_rejections = 0
        self.num_device_alloc = self.num_device_free = self.segment_count = 0
        self.oversize_allocations = self.oversize_segments = self.peak_oversize_allocations = 0
        self.peak_oversize_segments = 0
        self._live: dict[int, Block | None] = {}
        #: Blocks freed while another stream still used them (:meth:`free` ``awaiting``), by handle.
        self.awaiting: dict[int, Block] = {}
        self.awaiting_bytes = self.peak_awaiting_active = 0
        self._next_handle = 0
        self._allowed_max: int | None = None
        self._plain_rounding = not any(d > 1 for d in config.roundup_power2_divisions)
        self._limit = config.max_split_size  # the config is frozen: its hot fields are read once
        self._expandable = config.expandable_segments
        self._fit = FitRules(config.max_split_size, config.max_non_split_rounding, config.expandable_segments,
                             gc_on=False)
        self.set_memory_fraction(config.per_process_memory_fraction)

    # ----------------------------------------------------------------- public operations

    def set_memory_fraction(self, fraction: float) -> None:
        """``setMemoryFraction`` (``torch.cuda.set_per_process_memory_fraction``, and the allocator's constructor
        with ``per_process_memory_fraction`` of the config): below 1, ``allowed_memory_maximum`` is
        ``static_cast<size_t>(fraction * totalGlobalMem)``, and ``alloc_block`` refuses a segment that would take
        ``total_allocated_memory`` (reserved) past it, before ``cudaMalloc`` is asked; the garbage collector can
        run. It caps the allocator's segments, not the process: the CUDA context and libraries are outside it."""
        if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 <= fraction <= 1:
            raise InvalidArgumentError(f"fraction must be in [0, 1], got {fraction!r}")
        total = self.device_total
        if fraction < 1 and total is None:
            raise InvalidArgumentError("a memory fraction below 1 needs the device size: pass device_total= (or "
                                       "capacity=) to CachingAllocator")
        self._allowed_max = None if fraction >= 1 or total is None else int(fraction * total)  # truncated, as torch
        # The garbage collector counts block ages only under a fraction (garbage_collection_threshold needs one).
        gc_on = self._allowed_max is not None and self.config.garbage_collection_threshold > 0
        self._fit = self._fit._replace(gc_on=gc_on)

    @property
    def allowed_memory_maximum(self) -> int | None:
        """The memory fraction's cap on reserved bytes (``allowed_memory_maximum``); None without a fraction."""
        return self._allowed_max

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """``DeviceCachingAllocator::malloc`` on ``stream``; returns a handle for :meth:`free`. A zero-byte
        request takes no block (``NativeCachingAllocator::allocate`` skips ``malloc``)."""
        if type(nbytes) is not int or nbytes < 0:
            _check_size(nbytes)
        if type(stream) is not int:
            raise InvalidArgumentError(f"stream must be an int id, got {stream!r}")
        self._next_handle += 1
        if nbytes == 0:
            self._live[self._next_handle] = None
            return self._next_handle
        if nbytes < K_MIN_BLOCK_SIZE:
            size = K_MIN_BLOCK_SIZE
        elif self._plain_rounding:
            size = -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
        else:
            size = round_size(nbytes, self.config)
        small = size <= K_SMALL_SIZE
        block = get_free_block(self.pools, small, stream, size, self._fit)
        if block is None:
            block = new_block(self, small, stream, size, nbytes)
        remaining = block.size - size
        limit = self._limit
        if small or self._expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:  # should_split: large blocks split above 1 MiB of rest, and only below max_split_size
            split = remaining > K_SMALL_SIZE and (limit is None or size < limit)
        if split:  # alloc_found_block: the rest goes back to the free list
            head = Block(block.addr, size, stream, small, block.reg, block.segment)
            head.prev, head.next = block.prev, block
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            block.addr += size
            block.size = remaining
            self.pools.insert(block)
            block = head
        block.allocated = True
        block.requested = nbytes
        size = block.size
        self.allocated += size
        self.requested += nbytes
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.awaiting_bytes and self.allocated + self.awaiting_bytes > self.peak_awaiting_active:
            self.peak_awaiting_active = self.allocated + self.awaiting_bytes
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested
        if limit is not None and size >= limit:  # alloc_found_block: increase_stat(oversize_allocations)
            self.oversize_allocations += 1
            self.peak_oversize_allocations = max(self.peak_oversize_allocations, self.oversize_allocations)
        self._live[self._next_handle] = block
        return self._next_handle

    def free(self, handle: int, *, awaiting: bool = False) -> None:
        """``free_locked`` then ``free_block``: the block merges with free neighbours and stays cached. With
        ``awaiting`` the block was used on another stream (``record_stream``): ``free`` takes its bytes out of
        allocated now, but ``insert_events`` keeps it out of the cache, and out of its neighbours' merges, until
        the events complete: :meth:`release_awaiting` (``process_events``), or any release of the cache
        (:func:`~memprof.anatomy.alloc_events.synchronize_events`)."""
        try:
            block = self._live.pop(handle)
        except (KeyError, TypeError) as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            raise InvalidArgumentError(f"handle {handle!r} is not allocated (freed twice or never returned by "
                                       "malloc)") from None
        if block is None:
            return
        size = block.size
        self.allocated -= size
        self.requested -= block.requested
        if self._limit is not None and size >= self._limit:
            self.oversize_allocations -= 1
        if awaiting:
            await_events(self, handle, block)
        else:
            self._cache(block)

    def release_awaiting(self, handle: int) -> None:
        """The events of a block freed ``awaiting`` (:meth:`free`) completed: it joins the cache."""
        release_awaiting(self, handle)

    def _cache(self, block: Block) -> None:
        """``free_block``: merge with free neighbours of the segment (``try_merge_blocks``), then back to the free
        list (``insert_into_blocks``). Written out here, the hottest path of a replay."""
        block.allocated = False
        pools = self.pools
        frees = pools.free
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped:
            free = frees[(prev.small, prev.stream)]
            del free[bisect_left(free, (prev.size, prev.reg, prev.addr))]
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev = prev.prev
            if prev is not None:
                prev.next = block
        after = block.next
        if after is not None and not after.allocated and after.mapped:
            free = frees[(after.small, after.stream)]
            del free[bisect_left(free, (after.size, after.reg, after.addr))]
            block.size += after.size
            block.next = after = after.next
            if after is not None:
                after.prev = block
        block.gc_base = pools.gc_calls[block.small]
        bucket = frees.get((block.small, block.stream))
        if bucket is None:
            bucket = frees[(block.small, block.stream)] = []
        insort(bucket, (block.size, block.reg, block.addr, block))

    def empty_cache(self) -> None:
        """``emptyCache`` -> ``release_cached_blocks``: every whole free segment goes back to the device
        (large pool, then small); free pages of expandable segments are unmapped."""
        release_cached(self)

    def reset_peak_stats(self) -> None:
        """``resetPeakStats``: every peak restarts at the current value (the oversize counters' too)."""
        self.peak_allocated, self.peak_reserved, self.peak_requested = self.allocated, self.reserved, self.requested
        self.peak_awaiting_active = self.allocated + self.awaiting_bytes
        self.peak_oversize_allocations, self.peak_oversize_segments = self.oversize_allocations, self.oversize_segments

    @property
    def active(self) -> int:
        """``active_bytes``: allocated blocks plus freed ones still awaiting other streams' events."""
        return self.allocated + self.awaiting_bytes

    @property
    def peak_active(self) -> int:
        # awaiting bytes were allocated bytes just before: the active peak is the allocated one's, or higher
        # where a block was still awaiting its events when another was made
        return max(self.peak_allocated, self.peak_awaiting_active)

    # ----------------------------------------------------------------- views (alloc_snapshot)

    def blocks(self) -> list[Block]:
        """Every block: the free ones, the unmapped pieces of expandable segments, then the allocated ones."""
        return self.pools.all_blocks([*self._live.values(), *self.awaiting.values()])

    def segments(self) -> list[tuple[int, list[tuple[int, bool]]]]:
        """``[(segment_bytes, [(block_bytes, allocated), ...]), ...]`` in address order (segments in the
        order they were made, blocks in address order within each)."""
        return segments(self.pools, [*self._live.values(), *self.awaiting.values()])

    def snapshot(self) -> list[SnapshotSegment]:
        """The segments as ``torch.cuda.memory_snapshot()`` lists them (addresses are the model's own)."""
        return snapshot(self.pools, [*self._live.values(), *self.awaiting.values()])

    @property
    def inactive_split_bytes(self) -> int:
        """Free bytes in segments that are split (``inactive_split_bytes``; torch leaves expandable
        segments out of this statistic)."""
        return inactive_split_bytes(self.pools)

    def memory_stats(self) -> dict[str, int]:
        """The counters under ``torch.cuda.memory_stats()``'s key names (the ``all`` aggregate)."""
        return memory_stats(self)
