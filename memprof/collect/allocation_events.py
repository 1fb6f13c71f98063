"""An allocator's own events reduced to phase records: a pure function of an event list and what the hooks know.

The CUDA caching allocator records its actions in C++ while ``torch.cuda.memory._record_memory_history`` is on,
with no Python per op; ``torch.cuda.memory._snapshot()["device_traces"]`` returns them as dicts, one per action
(torch/csrc/cuda/memory_snapshot.cpp, ``_memory_snapshot_pickled``, and ``torch.cuda.memory._snapshot``'s
docstring)::

    {"action": "alloc" | "free_requested" | "free_completed" | "segment_alloc" | "segment_free"
               | "segment_map" | "segment_unmap" | "snapshot" | "oom",
     "addr": int,            # "device_free" instead, for "oom"
     "size": int,            # an alloc's size is the bytes asked for, before the allocator rounds them
     "stream": int, "time_us": int, "frames": [...], "compile_context": str, "user_metadata": str}

CPU's profiler gives the same facts for each allocation and free (``torch.profiler.profile(profile_memory=True)``,
one event per ``c10::reportMemoryUsageToProfiler``: address, signed bytes, time): :func:`from_profiler` turns
them into this shape, so that one reducer serves both.

:func:`reduce_window` replays the events of one window (a phase, between two boundaries) over what was live
when it began (:class:`Live`), and gives the window's start, peak and end by category. The category of an
allocation comes from what the hooks knew at the window's end, by address (``known``: the
``untyped_storage().data_ptr()`` of every parameter, gradient, optimizer state, saved tensor, input, cache and
communication buffer); every other allocation is a temporary. What the hooks know at the end applies to the
last allocation at that address in the window (the one still there, or the last one made there). An
allocation that changed category inside the window (a temporary that became a gradient) is counted under its
category at the window's end at every moment of the window: the dispatch mode's ledger moves it at the moment
it changes. A window whose event buffer may have overflowed is flagged (``complete=False``): its figures are
then not a measurement.

Nothing here imports torch: it is unit-tested on hand-made event lists, and runs the same on any machine.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Literal, Mapping, TypedDict

from ..errors import UnknownNameError
from ..record.trace import Breakdown
from ..vocabulary import Category, TENSOR_CATEGORIES

if TYPE_CHECKING:
    from ..record.aliases import JSON
    from .aliases import Row

__all__ = ["ALLOC", "FREES", "TraceEntry", "Snapshot", "Live", "Window", "reduce_window", "from_profiler", "split_at"]


class TraceEntry(TypedDict, total=False):
    """An entry of the allocator's history (``torch.cuda.memory._snapshot()["device_traces"][device]``, torch's own
    ``TraceEntry``), or one :func:`from_profiler` makes of a profiler's memory event: the keys memprof writes or
    reads. ``addr`` and ``action`` are in every entry; the others in those of an allocation or a free."""

    action: str
    addr: int
    size: int
    stream: int
    time_us: int
    time_ns: int  # the profiler's events only: its clock is finer
    frames: list[JSON]
    compile_context: str
    user_metadata: str


class Snapshot(TypedDict, total=False):
    """What memprof reads of ``torch.cuda.memory._snapshot()`` (torch's own ``Snapshot``): each device's history."""

    device_traces: list[list[TraceEntry]]


ALLOC = "alloc"
#: The actions that end an allocation. The caching allocator records ``free_requested`` when the tensor's
#: storage is released (``memory_allocated()`` drops then) and ``free_completed`` when the block may be reused
#: (later, when another stream still used it): the first one seen ends it, the second finds nothing to end.
FREES = frozenset({"free_requested", "free_completed"})
_TEMPORARIES = Category.TEMPORARIES.value
_CATEGORIES = frozenset(c.value for c in TENSOR_CATEGORIES)


@dataclasses.dataclass
class Live:
    """What is allocated between windows: address -> [bytes counted, category]. Carried from one window to the
    next (the allocations of the weights, made before the first window, are put here at the start)."""

    blocks: "dict[int, Row]" = dataclasses.field(default_factory=dict)

    def totals(self) -> dict[str, int]:
        """Bytes by category now."""
        out: dict[str, int] = {}
        for nbytes, cat in self.blocks.values():
            out[cat] = out.get(cat, 0) + nbytes
        return out


@dataclasses.dataclass(frozen=True)
class Window:
    """One window's record: what was allocated at its start, at its peak and at its end, by category.

    ``peak_event`` is the index (in the window's event list) of the allocation that reached the peak, -1 when the
    peak was the start; ``peak_time_us`` its ``time_us`` (None then). ``allocations`` and ``frees`` count the
    events replayed; ``unmatched_frees`` the frees of addresses allocated before anything was recorded (their
    bytes were never counted, and are not subtracted). ``complete`` is False when events may be missing."""

    start: Breakdown
    peak: Breakdown
    end: Breakdown
    peak_event: int
    peak_time_us: "int | None"
    allocations: int
    frees: int
    unmatched_frees: int
    complete: bool


def _round(nbytes: int, rounding: int) -> int:
    if rounding <= 1 or nbytes <= 0:
        return max(nbytes, 0)
    return -(-nbytes // rounding) * rounding


def _breakdown(totals: Mapping[str, int]) -> Breakdown:
    # Every tensor category is measured here (0 when nothing of it is live): an event source sees them all.
    return Breakdown.from_mapping({c.value: totals.get(c.value, 0) for c in TENSOR_CATEGORIES})


def _owners(events: "list[TraceEntry]", known: Mapping[int, str]) -> dict[int, int]:
    """For each known address, the index of the allocation the hooks' category applies to: the last one
    made there in the window (still live at its end, or the last to have lived there)."""
    owner: dict[int, int] = {}
    for i, ev in enumerate(events):
        if ev.get("action") == ALLOC:
            addr = ev["addr"]
            if addr in known:
                owner[addr] = i
    return owner


def reduce_window(events: Iterable[TraceEntry], live: Live, known: Mapping[int, str], *,
                  rounding: int = 1, complete: bool = True, sizes: "Mapping[int, int] | None" = None) -> Window:
    """Replay ``events`` (one window, in order) over ``live`` (updated in place to the window's end) and return
    the window's record.

    ``known`` maps the address of each storage the hooks know to its category value (``"gradients"`` ...);
    an allocation it does not name is a temporary. Blocks carried in ``live`` take the category ``known`` gives
    their address at the window's end (a saved activation freed in backward keeps the category it was carried
    with). ``rounding`` counts each allocation as a multiple of it (512 on CUDA, as memory_allocated() does).
    Actions other than allocations and frees (segments, snapshots, out-of-memory) change nothing allocated."""
    evs = list(events)
    for cat in known.values():
        if cat not in _CATEGORIES:
            raise UnknownNameError(f"unknown category {cat!r} in the address map; use one of {sorted(_CATEGORIES)}")
    blocks = live.blocks
    # What was carried in takes the category the hooks give its address now (a storage moves between
    # categories: a tensor became .grad), unless the window allocates at that address again.
    allocated_here = {ev["addr"] for ev in evs if ev.get("action") == ALLOC}
    for addr, block in blocks.items():
        given = known.get(addr)
        if given is not None and addr not in allocated_here:
            block[1] = given
    owners = _owners(evs, known)
    totals = live.totals()
    start = dict(totals)
    for addr, nbytes in (sizes or {}).items():
        if addr in allocated_here or addr not in known:
            continue
        carried = blocks.get(addr)
        if carried is None:
            cat = known[addr]
            blocks[addr] = [nbytes, cat]
            totals[cat] = totals.get(cat, 0) + nbytes
        elif carried[0] != nbytes:
            # The block carried here was freed and its address given to this storage by events the window does
            # not hold (a buffer that dropped them): the storage the hooks know replaces it.
            totals[carried[1]] += nbytes - carried[0]
            carried[0] = nbytes
    total = sum(totals.values())
    peak_total, peak, peak_event, peak_time = total, dict(totals), -1, None
    allocs = frees = unmatched = 0
    # With both kinds of free in the list, a free_completed after its free_requested finds nothing: not a loss.
    requested = any(ev.get("action") == "free_requested" for ev in evs)
    for i, ev in enumerate(evs):
        action = ev.get("action")
        if action == ALLOC:
            allocs += 1
            addr = ev["addr"]
            old = blocks.pop(addr, None)
            if old is not None:  # a free the buffer lost: the block cannot be allocated twice
                totals[old[1]] -= old[0]
                total -= old[0]
            nbytes = _round(int(ev["size"]), rounding)
            cat = known[addr] if owners.get(addr) == i else _TEMPORARIES
            blocks[addr] = [nbytes, cat]
            totals[cat] = totals.get(cat, 0) + nbytes
            total += nbytes
            if total > peak_total:
                peak_total, peak, peak_event, peak_time = total, dict(totals), i, ev.get("time_us")
        elif action in FREES:
            freed = blocks.pop(ev["addr"], None)
            if freed is None:
                if action == "free_requested" or not requested:
                    unmatched += 1
                continue
            frees += 1
            totals[freed[1]] -= freed[0]
            total -= freed[0]
    return Window(start=_breakdown(start), peak=_breakdown(peak), end=_breakdown(totals), peak_event=peak_event,
                  peak_time_us=peak_time, allocations=allocs, frees=frees, unmatched_frees=unmatched,
                  complete=complete)


def from_profiler(events: Iterable[tuple[int, int, int]]) -> list[TraceEntry]:
    """``(time_ns, addr, signed bytes)`` per profiler memory event, as the allocator's trace entries: a
    positive size is an allocation, a negative one a free (of the block allocated at that address)."""
    out: list[TraceEntry] = []
    for time_ns, addr, nbytes in events:
        action = ALLOC if nbytes > 0 else "free_completed"
        # time_ns kept beside time_us: the profiler's clock is finer, and phase markers fall between events.
        out.append({"action": action, "addr": addr, "size": abs(nbytes), "stream": 0, "time_us": time_ns // 1000,
                    "time_ns": time_ns, "frames": [], "compile_context": "", "user_metadata": ""})
    return out


def split_at(events: "list[TraceEntry]", boundaries: "list[int]", key: 'Literal["time_us", "time_ns"]' = "time_us"
             ) -> "list[list[TraceEntry]]":
    """``events`` (ordered by ``key``: ``"time_us"``, or ``"time_ns"`` for the profiler's) cut at each boundary
    time (same unit, ascending): len(boundaries) + 1 windows, an event at a boundary's very time falling in the
    later window."""
    windows: list[list[TraceEntry]] = [[] for _ in range(len(boundaries) + 1)]
    j = 0
    for ev in events:
        t = ev.get(key, 0)
        while j < len(boundaries) and t >= boundaries[j]:
            j += 1
        windows[j].append(ev)
    return windows
