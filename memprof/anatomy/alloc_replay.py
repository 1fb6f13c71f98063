"""Replay a stream of allocation events through the caching-allocator model.

An event is ``(op, key, nbytes, stream)``: ``op`` is ``"alloc"`` (or ``"malloc"``), ``"free"`` or
``"empty_cache"``; ``key`` names the tensor (any hashable, unique while it lives); ``nbytes`` and ``stream``
matter only for an allocation and may be left off a free (``("free", key)``). The replay keeps the peaks,
where they happened and, on request, the allocated and reserved bytes after every event.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import InvalidArgumentError, SimulatedOutOfMemoryError
from .alloc_config import AllocatorConfig
from .allocator import CachingAllocator

__all__ = ["ReplayOOM", "ReplayResult", "replay"]

_ALLOC = frozenset({"alloc", "malloc"})


@dataclass(frozen=True)
class ReplayOOM:
    """The event the model could not serve: its index, key and size, and the allocator's state then."""

    index: int
    key: object
    requested: int
    allocated: int
    reserved: int
    message: str


@dataclass(frozen=True)
class ReplayResult:
    """Peaks of a replay (bytes), the event index where each was first reached, and the final state.

    ``events`` counts the events replayed (up to and including an OOM). ``allocated`` and ``reserved`` are
    ``array('q')`` of the bytes after each event when ``timeline=True``, else ``None``. ``allocator`` is
    the model at the end, for ``segments()`` and ``memory_stats()``.
    """

    events: int
    peak_allocated: int
    peak_reserved: int
    peak_allocated_at: int
    peak_reserved_at: int
    final_allocated: int
    final_reserved: int
    num_alloc_retries: int
    num_ooms: int
    oom: ReplayOOM | None
    allocated: array | None
    reserved: array | None
    allocator: CachingAllocator

    @property
    def fits(self) -> bool:
        return self.oom is None


def replay(events: Iterable, config: AllocatorConfig | None = None, *, capacity: int | None = None,
           device_total: int | None = None, timeline: bool = False,
           allocator: CachingAllocator | None = None) -> ReplayResult:
    """Run ``events`` through a fresh ``CachingAllocator(config, capacity, device_total)`` (or through
    ``allocator``, continuing its state) and stop at the first predicted out-of-memory error."""
    if allocator is None:
        allocator = CachingAllocator(config, capacity=capacity, device_total=device_total)
    elif config is not None or capacity is not None or device_total is not None:
        raise InvalidArgumentError("give either allocator= or config/capacity/device_total, not both")
    malloc, free = allocator.malloc, allocator.free
    handles: dict = {}
    allocated_line = array("q") if timeline else None
    reserved_line = array("q") if timeline else None
    peak_allocated, peak_reserved = allocator.peak_allocated, allocator.peak_reserved
    peak_allocated_at = peak_reserved_at = -1
    oom = None
    index = -1
    pop = handles.pop
    for index, event in enumerate(events):
        op = event[0]
        if op == "free":  # half the events: tested first
            try:
                free(pop(event[1]))
            except KeyError:
                raise InvalidArgumentError(f"event {index}: free of {event[1]!r}, which is not allocated") from None
        elif op in _ALLOC:
            key = event[1]
            if key in handles:
                raise InvalidArgumentError(f"event {index}: {key!r} is allocated twice without a free in between")
            try:
                handles[key] = malloc(event[2], event[3] if len(event) > 3 else 0)
            except SimulatedOutOfMemoryError as error:
                oom = ReplayOOM(index, key, event[2], allocator.allocated, allocator.reserved, str(error))
                break
            if allocator.allocated > peak_allocated:
                peak_allocated, peak_allocated_at = allocator.allocated, index
            if allocator.reserved > peak_reserved:
                peak_reserved, peak_reserved_at = allocator.reserved, index
        elif op == "empty_cache":
            allocator.empty_cache()
        else:
            raise InvalidArgumentError(
                f"event {index}: unknown op {op!r}; the ops are 'alloc', 'free' and 'empty_cache'")
        if timeline:
            allocated_line.append(allocator.allocated)
            reserved_line.append(allocator.reserved)
    return ReplayResult(
        events=index + 1, peak_allocated=allocator.peak_allocated, peak_reserved=allocator.peak_reserved,
        peak_allocated_at=peak_allocated_at, peak_reserved_at=peak_reserved_at,
        final_allocated=allocator.allocated, final_reserved=allocator.reserved,
        num_alloc_retries=allocator.num_alloc_retries, num_ooms=allocator.num_ooms, oom=oom,
        allocated=allocated_line, reserved=reserved_line, allocator=allocator)
