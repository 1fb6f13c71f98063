"""A ledger's allocation stream as the replay reads it: where the run starts in it, its replay through the model
of torch's caching allocator, what is wrong with a malformed one, and the check that it is the ledger's own.

A stream is a sequence of ``(seq, key, bytes)`` (:meth:`memprof.collect.ledger.Ledger.record_stream`): a storage
made (or resized: a key made again while it lives), ``bytes`` >= 0, or freed, ``bytes`` == -1; ``seq`` is the
ledger's event count, which the trace's moments name.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Hashable, Mapping, MutableSequence, Sequence
from fractions import Fraction
from typing import Callable

from ..anatomy.alloc_audit import AuditedAllocator
from ..anatomy.alloc_config import AllocatorConfig
from ..anatomy.allocator import CachingAllocator
from ..collect.streams import ONE_STREAM, StreamUse
from ..errors import InvalidArgumentError, SimulatedOutOfMemoryError, is_interrupt

__all__ = ["FREE", "from_start", "rank_step", "replay_stream", "stream_problem", "check_stream"]

#: The bytes of a free in a stream; every other event's bytes are a size, never negative.
FREE = -1


def from_start(stream: Sequence[tuple[int, int, int]], first: int) -> list[tuple[int, int, int]]:
    """``stream`` from the run's start, event ``first``: the events up to it give way to one allocation per
    storage live then, at its size then, in the order the storages were made (each at the seq it was made).

    What a stream holds before its run starts is the profile's set-up, which the run's figures leave out: a
    simulated rank registers the whole model and then shards it (the ledger restarts its peak there), so a
    replay of the set-up would allocate the whole model on one rank, which no rank does."""
    live: dict[int, tuple[int, int]] = {}
    try:
        cut = len(stream)
        for index, (seq, key, nbytes) in enumerate(stream):
            if seq > first:
                cut = index
                break
            if type(nbytes) is not int or nbytes < FREE:
                raise ValueError(nbytes)
            if nbytes == FREE:
                del live[key]
            elif key in live:
                live[key] = (live[key][0], nbytes)  # resized: the storage was made when it was first made
            else:
                live[key] = (seq, nbytes)
    except (TypeError, ValueError, KeyError) as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise _bad_stream(stream, exc) from None
    return [(seq, key, nbytes) for key, (seq, nbytes) in live.items()] + list(stream[cut:])


def rank_step(stream: MutableSequence[tuple[int, int, int]], start_seq: int, resized_from: int,
              share: "Fraction | None", rounding: int) -> None:
    """Rewrite, in place, an optimizer step a simulated rank ran on the whole model's shapes (the events after
    ``start_seq``) as the rank makes it, the way :meth:`memprof.simulate.ranks.LayoutPlan.finish` rewrites the
    step's figures: the state the step made like the whole parameters and resized to the rank's part at its end
    (the events from index ``resized_from`` on) is made at that part, its resize gone; every other storage the
    step made takes ``share`` of its bytes as the ledger counts them (rounded to ``rounding``), rounded up, so
    that the stream never holds less than the rank's figures; storages made before the step keep theirs.
    Without ``share`` only the state is rewritten."""
    final = {key: nbytes for _seq, key, nbytes in stream[resized_from:]}
    begin = bisect_right(stream, start_seq, key=lambda e: e[0])
    live = set()
    for _seq, key, nbytes in stream[:begin]:
        if nbytes == FREE:
            live.discard(key)
        else:
            live.add(key)
    made: dict[int, bool] = {}  # storages the step made and still holds -> whether they are state
    out = []
    for seq, key, nbytes in stream[begin:resized_from]:
        if nbytes == FREE:
            made.pop(key, None)
            live.discard(key)
        elif key in made or key not in live:
            if made.get(key):
                continue  # the state, made at the rank's part, is not resized on the way
            state = made.setdefault(key, key in final)
            live.add(key)
            if state:
                nbytes = final[key]
            elif share is not None:
                counted = -(-nbytes // rounding) * rounding if rounding > 1 else nbytes
                nbytes = -(-counted * share.numerator // share.denominator)
        out.append((seq, key, nbytes))
    # The resizes at the end stay only for state the step did not make (an earlier step's, resized again).
    out += [e for e in stream[resized_from:] if e[1] not in made]
    stream[begin:] = out


def stream_problem(event: object, live: "set[Hashable] | None" = None) -> "str | None":
    """What is wrong with one event of a stream, None when nothing is; with ``live`` (the keys live before it,
    updated here) also a free of a key that is not live."""
    if not isinstance(event, (tuple, list)) or len(event) != 3:
        return "an event is (seq, key, bytes): bytes >= 0 for a storage made or resized, -1 for a free"
    seq, key, nbytes = event
    if type(seq) is not int:
        return f"seq {seq!r} is not an int"
    if type(nbytes) is not int:
        return f"bytes {nbytes!r} is not an int"
    if nbytes < FREE:
        return f"bytes {nbytes} is negative: a free is written -1, and no storage has a negative size"
    try:
        hash(key)
    except TypeError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return f"the key {key!r} is not hashable"
    if live is not None:
        if nbytes == FREE:
            if key not in live:
                return f"a free of key {key!r}, which is not live (freed twice, or never made)"
            live.discard(key)
        else:
            live.add(key)
    return None


def _bad_stream(stream: Sequence[object], exc: BaseException) -> InvalidArgumentError:
    if not isinstance(stream, (list, tuple)) and not hasattr(stream, "__getitem__"):
        return InvalidArgumentError(f"an allocation stream is a sequence of (seq, key, bytes), got "
                                    f"{type(stream).__name__}")
    live: set[Hashable] = set()
    for index, event in enumerate(stream):
        problem = stream_problem(event, live)
        if problem is not None:
            shown = repr(event) if len(repr(event)) <= 120 else repr(event)[:117] + "..."
            return InvalidArgumentError(f"allocation stream event {index} {shown}: {problem}")
    return InvalidArgumentError(f"the allocation stream could not be replayed: {exc}")


class _Placement:
    """Where a replay makes each storage and how its block goes back, by the run's :class:`StreamUse`: on the
    stream of the last switch before the storage's seq; a held storage's block, let go, waits for its events
    (``free(awaiting=True)``), and a held storage made while ``limit`` blocks wait releases the oldest first (the
    library's rate limiter waited for their events before it gathered again)."""

    def __init__(self, allocator: CachingAllocator, streams: StreamUse) -> None:
        self.allocator = allocator
        self.switches = streams.switches
        self.at_seqs = [seq for seq, _stream in streams.switches]
        self.held = dict(streams.held)
        self.waiting: deque[int] = deque()  # handles of held blocks awaiting their events, the oldest first
        self.made_held: dict[int, int] = {}  # handle -> bytes, for held storages' blocks

    def make(self, seq: int, key: int, nbytes: int) -> int:
        i = bisect_left(self.at_seqs, seq)  # the switches noted before the storage was made (at a smaller seq)
        stream = self.switches[i - 1][1] if i else 0
        limit = self.held.get(key)
        if limit is None:
            return self.allocator.malloc(nbytes, stream)
        if nbytes > 0:
            while len(self.waiting) >= limit:
                self.allocator.release_awaiting(self.waiting.popleft())
        handle = self.allocator.malloc(nbytes, stream)
        self.made_held[handle] = nbytes
        return handle

    def let_go(self, handle: int) -> None:
        if self.made_held.pop(handle, 0) > 0:
            self.allocator.free(handle, awaiting=True)
            self.waiting.append(handle)
        else:
            self.allocator.free(handle)


def replay_stream(stream: Sequence[tuple[int, int, int]], seqs: Sequence[int], config: AllocatorConfig, *,
                  workspaces: Sequence[int] = (), workspace_seq: int = 0, capacity: "int | None" = None,
                  device_total: "int | None" = None, check: bool = False,
                  streams: StreamUse = ONE_STREAM,
                  ) -> tuple[dict[int, tuple[int, int]], CachingAllocator, "str | None"]:
    """Replay a ledger's stream (a key made again while live is a resize: the new block is taken before the old
    one is freed, as ``resize_`` copies) through a fresh :class:`CachingAllocator`, allocating ``workspaces``
    (kept to the end) as the run passes event ``workspace_seq``. ``streams``
    (:class:`~memprof.collect.streams.StreamUse`): its switches say on which stream each storage is made (that of
    the last switch before its seq; none, stream 0 for all; a resize is made on the stream current then); a held
    storage's block, when freed or resized, waits for its events (``free(awaiting=True)``) until a held storage is
    made while ``limit`` blocks wait, which releases the oldest first.

    Returns (allocated, reserved) after the last event at or before each of ``seqs``, the allocator at the
    end, and the message of a predicted out-of-memory error (the replay stops there; later moments read the
    state at the error) or None. A malformed event raises :class:`~memprof.errors.InvalidArgumentError` naming
    it and its index (:func:`stream_problem`). ``check=True`` audits the allocator after every event
    (:class:`~memprof.anatomy.alloc_audit.AuditedAllocator`)."""
    kind = AuditedAllocator if check else CachingAllocator
    allocator = kind(config, capacity=capacity, device_total=device_total)
    malloc, free = allocator.malloc, allocator.free
    wanted = sorted(set(seqs))
    at: dict[int, tuple[int, int]] = {}
    w, n_wanted = 0, len(wanted)
    handles: dict[int, int] = {}
    pending = list(workspaces)
    oom = None
    make: Callable[[int, int, int], int]
    let_go: Callable[[int], None]
    if streams.switches or streams.held:
        placement = _Placement(allocator, streams)
        make, let_go = placement.make, placement.let_go
    else:  # one stream, nothing held: the replay's hot loop as plain as it can be
        make, let_go = (lambda _seq, _key, nbytes: malloc(nbytes, 0)), free
    try:
        try:
            if pending and workspace_seq <= 0:
                for nbytes in pending:
                    malloc(nbytes, 0)
                pending = []
            for seq, key, nbytes in stream:
                if pending and seq > workspace_seq:  # the run passed workspace_seq between two events
                    for size in pending:
                        malloc(size, 0)
                    pending = []
                while w < n_wanted and wanted[w] < seq:
                    at[wanted[w]] = (allocator.allocated, allocator.reserved)
                    w += 1
                if nbytes < 0:
                    if nbytes != FREE:
                        raise ValueError(nbytes)
                    let_go(handles.pop(key))
                else:
                    old = handles.get(key)
                    handles[key] = make(seq, key, nbytes)
                    if old is not None:
                        let_go(old)
                if pending and seq >= workspace_seq:
                    for size in pending:
                        malloc(size, 0)
                    pending = []
        except (TypeError, ValueError, KeyError) as exc:  # InvalidArgumentError is a TypeError
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            raise _bad_stream(stream, exc) from None
    except SimulatedOutOfMemoryError as error:
        if is_interrupt(error):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        oom = str(error)
    state = (allocator.allocated, allocator.reserved)
    while w < n_wanted:
        at[wanted[w]] = state
        w += 1
    return at, allocator, oom


def check_stream(stream: Sequence[tuple[int, int, int]], rounding: int, expected: Mapping[int, int],
                 ceiling: int, scaled: Sequence[tuple[int, int]] = (),
                 phases: Sequence[tuple[int, int, int]] = ()) -> None:
    """The stream is the ledger's own: its live bytes (each size rounded up to ``rounding``, as the ledger
    counts them) are, after the last event at or before each seq of ``expected``, the figure there, and never
    above the figures' peak ``ceiling``, nor, inside each of ``phases`` (start, end, its peak: seqs (start, end]),
    above that phase's peak. In the ``scaled`` spans of seqs (start, end] (a simulated rank's
    optimizer steps, :func:`rank_step`) the figures took the rank's share of a sum where the stream took each
    storage's share rounded up: there the stream may hold more, by less than ``rounding`` + 1 bytes for each live
    storage made in such a span, never less. Raises ``AssertionError`` naming the first event that breaks it.
    A check for tests and ``MEMPROF_CHECK_REPLAY=1``; a replay never pays for it."""
    sizes: dict[int, int] = {}
    rescaled: set[Hashable] = set()  # live storages made in a scaled span
    spans, p = sorted(phases, key=lambda s: (s[1], s[0])), 0  # by their ends: the first not yet ended is at p
    n_spans = len(spans)
    total = 0
    wanted = sorted(expected)
    w, n_wanted = 0, len(wanted)
    # Every event is checked, so the loop below is written for its common case (nothing to compare, no scaled
    # span, one phase open): about 28,000 events an estimate extended in depth.
    scaled = list(scaled)

    def inside(seq: int) -> bool:
        return any(start < seq <= end for start, end in scaled)

    def compare(seq_before: "int | float") -> None:
        nonlocal w
        while w < n_wanted and wanted[w] < seq_before:
            want = expected[wanted[w]]
            loose = len(rescaled) * (rounding + 1) if scaled and inside(wanted[w]) else 0
            if not want <= total <= want + loose:
                raise AssertionError(f"at seq {wanted[w]} the stream holds {total} B live, the figures {want} B"
                                     + (f" (up to {loose} B more allowed)" if loose else ""))
            w += 1

    for index, (seq, key, nbytes) in enumerate(stream):
        if w < n_wanted and wanted[w] < seq:
            compare(seq)
        if key in sizes:
            total -= sizes.pop(key)
            rescaled.discard(key)
        if nbytes != FREE:
            size = sizes[key] = -(-nbytes // rounding) * rounding if rounding > 1 else nbytes
            total += size
            if scaled and inside(seq):
                rescaled.add(key)
        loose = len(rescaled) * (rounding + 1) if rescaled else 0
        if total > ceiling + loose:
            raise AssertionError(f"event {index} (seq {seq}): the stream holds {total} B live, above the figures' "
                                 f"peak of {ceiling} B: the replay runs events the run's figures do not count")
        while p < n_spans and spans[p][1] < seq:
            p += 1
        q = p
        while q < n_spans:
            start, end, top = spans[q]
            if start >= seq:
                break
            if seq <= end and total > top + loose:
                raise AssertionError(f"event {index} (seq {seq}): the stream holds {total} B live, above the peak "
                                     f"of {top} B of the phase it falls in: that phase's peak is another moment")
            q += 1
    compare(float("inf"))
