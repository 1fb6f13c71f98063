"""Replay a stream of allocation events through the caching-allocator model.

An event is ``(op, key, nbytes, stream)``: ``op`` is ``"alloc"`` (or ``"malloc"``), ``"free"`` or
``"empty_cache"``; ``key`` names the tensor (any hashable, unique while it lives); ``nbytes`` and ``stream``
matter only for an allocation and may be left off a free (``("free", key)``). The replay keeps the peaks,
where they happened and, on request, the allocated and reserved bytes after every event.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from ..errors import InvalidArgumentError, SimulatedOutOfMemoryError, is_interrupt
from .alloc_config import AllocatorConfig
from .allocator import CachingAllocator

__all__ = ["Event", "ReplayOOM", "ReplayResult", "replay"]

_ALLOC = frozenset({"alloc", "malloc"})

#: An event: ``("alloc", key, nbytes[, stream])``, ``("free", key)`` or ``("empty_cache",)``; whatever else comes
#: is refused, naming it.
Event = Sequence[object]


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
    allocated: array[int] | None
    reserved: array[int] | None
    allocator: CachingAllocator

    @property
    def fits(self) -> bool:
        return self.oom is None


def replay(events: Iterable[Event], config: AllocatorConfig | None = None, *, capacity: int | None = None,
           device_total: int | None = None, timeline: bool = False,
           allocator: CachingAllocator | None = None, check: bool = False) -> ReplayResult:
    """Run ``events`` through a fresh ``CachingAllocator(config, capacity, device_total)`` (or through
    ``allocator``, continuing its state) and stop at the first predicted out-of-memory error.

    A malformed event (not a tuple, the wrong length, a size that is not a non-negative int, a stream that is not
    an int, an unhashable key, a free of a key not allocated, a key allocated twice) raises
    :class:`~memprof.errors.InvalidArgumentError` naming the event and its index. ``check=True`` audits the
    allocator after every event (:class:`~memprof.anatomy.alloc_audit.AuditedAllocator`; slow, for tests)."""
    if allocator is None:
        if check:
            from .alloc_audit import AuditedAllocator

            allocator = AuditedAllocator(config, capacity=capacity, device_total=device_total)
        else:
            allocator = CachingAllocator(config, capacity=capacity, device_total=device_total)
    elif config is not None or capacity is not None or device_total is not None or check:
        raise InvalidArgumentError("give either allocator= or config/capacity/device_total/check, not both")
    try:
        iterator = iter(events)
    except TypeError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise InvalidArgumentError(f"events must be an iterable of events ('alloc', key, nbytes[, stream]), "
                                   f"('free', key), ('empty_cache',); got {type(events).__name__}") from None
    run = _Run(allocator, timeline)
    index = -1
    for index, event in enumerate(iterator):
        try:
            stop = run.event(index, event)
        except InvalidArgumentError as error:
            if is_interrupt(error):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            raise InvalidArgumentError(f"event {index} {_shown(event)}: {error}") from None
        except (TypeError, IndexError, ValueError) as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            why = _malformed(event)
            # An event that reads well here but failed all the same is the model's defect: its cause stays chained.
            raise InvalidArgumentError(f"event {index} {_shown(event)}: {why or 'the model could not replay it'}") \
                from (None if why else exc)
        if stop:
            break
        run.note(index)
    return run.result(index + 1)


def _shown(event: object) -> str:
    text = repr(event)
    return text if len(text) <= 120 else text[:117] + "..."


def _malformed(event: object) -> str:
    """What is wrong with an event the replay could not read; "" when nothing is."""
    if not isinstance(event, (tuple, list)) or not event:
        return ("an event is a tuple ('alloc', key, nbytes[, stream]), ('free', key) or ('empty_cache',), "
                f"got {type(event).__name__}")
    op = event[0]
    if op in _ALLOC and len(event) not in (3, 4):
        return f"an allocation is ('alloc', key, nbytes) or ('alloc', key, nbytes, stream), got {len(event)} fields"
    if op == "free" and len(event) < 2:
        return "a free is ('free', key)"
    try:
        hash(event[1]) if len(event) > 1 else None
    except TypeError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return f"the key {event[1]!r} is not hashable; name tensors by a hashable key (an int, a string)"
    return ""


class _Run:
    """One replay's state: the allocator, the live keys' handles, the peaks and the timelines."""

    def __init__(self, allocator: CachingAllocator, timeline: bool) -> None:
        self.allocator = allocator
        self.handles: dict[object, int] = {}
        self.allocated_line = array("q") if timeline else None
        self.reserved_line = array("q") if timeline else None
        self.peak_allocated, self.peak_reserved = allocator.peak_allocated, allocator.peak_reserved
        self.peak_allocated_at = self.peak_reserved_at = -1
        self.oom: ReplayOOM | None = None

    def event(self, index: int, event: Event) -> bool:
        """Replay event ``index``; True when it is a predicted out-of-memory error (then ``oom`` says which)."""
        op = event[0]
        allocator = self.allocator
        if op == "free":
            try:
                handle = self.handles.pop(event[1])
            except KeyError as failure:
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                raise InvalidArgumentError(f"free of {event[1]!r}, which is not allocated (freed twice, or never "
                                           "allocated)") from None
            allocator.free(handle)
        elif op in _ALLOC:
            if len(event) not in (3, 4):
                raise IndexError
            key = event[1]
            if key in self.handles:
                raise InvalidArgumentError(f"{key!r} is allocated twice without a free in between")
            # Read as malloc's arguments: malloc refuses a size that is not a non-negative int, a stream not an int.
            nbytes, stream = cast(int, event[2]), cast(int, event[3] if len(event) > 3 else 0)
            try:
                self.handles[key] = allocator.malloc(nbytes, stream)
            except SimulatedOutOfMemoryError as error:
                if is_interrupt(error):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                self.oom = ReplayOOM(index, key, nbytes, allocator.allocated, allocator.reserved, str(error))
                return True
        elif op == "empty_cache":
            allocator.empty_cache()
        else:
            raise InvalidArgumentError(f"unknown op {op!r}; the ops are 'alloc', 'free' and 'empty_cache'")
        return False

    def note(self, index: int) -> None:
        allocator = self.allocator
        if allocator.allocated > self.peak_allocated:
            self.peak_allocated, self.peak_allocated_at = allocator.allocated, index
        if allocator.reserved > self.peak_reserved:
            self.peak_reserved, self.peak_reserved_at = allocator.reserved, index
        if self.allocated_line is not None and self.reserved_line is not None:
            self.allocated_line.append(allocator.allocated)
            self.reserved_line.append(allocator.reserved)

    def result(self, events: int) -> ReplayResult:
        a = self.allocator
        return ReplayResult(
            events=events, peak_allocated=a.peak_allocated, peak_reserved=a.peak_reserved,
            peak_allocated_at=self.peak_allocated_at, peak_reserved_at=self.peak_reserved_at,
            final_allocated=a.allocated, final_reserved=a.reserved, num_alloc_retries=a.num_alloc_retries,
            num_ooms=a.num_ooms, oom=self.oom, allocated=self.allocated_line, reserved=self.reserved_line,
            allocator=a)
