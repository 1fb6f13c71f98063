"""A run as a memory snapshot in the format of ``torch.cuda.memory._snapshot()``, for memory_viz; and
the reverse, a real snapshot's blocks attributed to memprof's categories (:func:`attribute_snapshot`).

pytorch.org/memory_viz and ``torch.cuda._memory_viz`` (``trace_plot``, ``segment_plot``, ``segments``,
``memory``, ``trace``) read a pickled dict with ``segments`` (what is allocated at the end) and
``device_traces`` (one list of ``alloc`` / ``free_requested`` / ``free_completed`` events per device).
Each event's ``frames`` are what the viewer shows when a block is selected; here they name memprof's
category, the module and the phase (``category: activations``, ``module: layers.0.attn``,
``phase: forward (step 1)``).

What a block is: memprof records categories over time, not each allocation's address. Between two
moments of the memory curve (:mod:`memprof.render.curve`), the growth of a category becomes one block
and its shrinking frees that category's latest blocks (a partly freed block is freed and its remainder
allocated again, with its frames). So the stacked plot's height and colors by category are exact at
every recorded moment, and a block is "what this category gained during this module or phase", not
one tensor. Addresses are synthetic; a freed range is reused first-fit, so the segment is about the
size of the run's peak, not of everything ever allocated.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, TypedDict

from ..errors import is_interrupt
from ..record.aliases import UserObject
from ..record.trace import as_trace
from .curve import curve

if TYPE_CHECKING:
    from ..record.aliases import JSONObject
    from ..record.trace import Trace

__all__ = ["memory_viz_snapshot", "attribute_snapshot", "read_snapshot", "UNSEEN", "MemoryVizSnapshot",
           "AttributedBlock"]


# The snapshot's parts, as torch.cuda.memory._snapshot() gives them (its docstring's Snapshot, Segment, Block,
# TraceEntry and Frame): the keys memory_viz reads.
class Frame(TypedDict):
    filename: str
    line: int
    name: str


class Block(TypedDict):
    address: int
    size: int
    requested_size: int
    state: str
    frames: list[Frame]


class Segment(TypedDict):
    device: int
    address: int
    total_size: int
    stream: int
    segment_type: str
    allocated_size: int
    active_size: int
    requested_size: int
    blocks: list[Block]


class TraceEntry(TypedDict):
    action: str
    addr: int
    size: int
    stream: int
    frames: list[Frame]
    time_us: int


class MemoryVizSnapshot(TypedDict):
    """The snapshot memory_viz opens, with memprof's note of what its blocks are."""

    segments: list[Segment]
    device_traces: list[list[TraceEntry]]
    memprof: JSONObject


class AttributedBlock(TypedDict):
    """An active block of a real snapshot, with memprof's category and module (:func:`attribute_snapshot`)."""

    address: int
    size: int
    requested_size: int
    category: str
    module: "str | None"
    device: "int | None"

#: Where synthetic addresses start (any nonzero base; the viewers print addresses in hex).
_BASE = 0x7F0000000000


class _Space:
    """Synthetic addresses: a freed range is reused first-fit, so the segment's size is a footprint
    (the run's high-water mark, plus what this layout fragments), not the sum of every allocation."""

    def __init__(self) -> None:
        self.free: list[list[int]] = []  # [addr, size], by address
        self.end = _BASE

    def take(self, size: int) -> int:
        for i, (addr, room) in enumerate(self.free):
            if room >= size:
                if room == size:
                    del self.free[i]
                else:
                    self.free[i] = [addr + size, room - size]
                return addr
        if self.free and self.free[-1][0] + self.free[-1][1] == self.end:  # grow the free tail
            addr = self.free.pop()[0]
        else:
            addr = self.end
        self.end = max(self.end, addr + size)
        return addr

    def give(self, addr: int, size: int) -> None:
        i = bisect.bisect(self.free, [addr, size])
        self.free.insert(i, [addr, size])
        if i + 1 < len(self.free) and addr + size == self.free[i + 1][0]:  # merge with the next
            self.free[i][1] += self.free.pop(i + 1)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == addr:  # and with the previous
            self.free[i - 1][1] += self.free.pop(i)[1]


def _frames(category: str, module: "str | None", phase: str, step: int) -> list[Frame]:
    return [
        {"filename": "memprof", "line": 0, "name": f"category: {category}"},
        {"filename": "memprof", "line": 0, "name": f"module: {module or '(no module running)'}"},
        {"filename": "memprof", "line": step, "name": f"phase: {phase} (step {step})"},
    ]


def memory_viz_snapshot(trace: "Trace") -> MemoryVizSnapshot:
    """The snapshot dict (pickle it, or use :meth:`memprof.Report.export_memory_viz`)."""
    t = as_trace(trace)
    cv = curve(t)
    device = (t.device.index or 0) if t.device.type == "cuda" else 0
    events: list[TraceEntry] = []
    live: dict[str, list[tuple[int, int, list[Frame]]]] = {}  # category -> blocks (addr, size, frames), oldest first
    level: dict[str, int] = {}
    space = _Space()
    stack: list[str] = []  # the modules running, innermost last
    for pt in cv.points:
        # Growth seen at a module's exit happened inside it; at an entry, in whatever ran before.
        where = pt.module if pt.kind == "exit" else (stack[-1] if stack else None)
        if pt.kind == "enter" and pt.module is not None:
            stack.append(pt.module)
        elif pt.kind == "exit" and pt.module in stack:
            del stack[len(stack) - 1 - stack[::-1].index(pt.module):]
        elif pt.kind in ("start", "phase"):
            stack.clear()
        for cat, value in pt.breakdown.measured().items():
            name = cat.value
            delta = value - level.get(name, 0)
            level[name] = value
            blocks = live.setdefault(name, [])
            frames: "list[Frame] | None" = None
            while delta < 0 and blocks:
                addr, size, frames = blocks.pop()
                events.append(_event("free_requested", addr, size, frames, pt.time_us))
                events.append(_event("free_completed", addr, size, frames, pt.time_us))
                space.give(addr, size)
                if size > -delta:  # only part of it went: the rest stays, as a block of its own
                    delta = size + delta
                    break
                delta += size
            if delta > 0:
                frames = frames or _frames(name, where, pt.phase.value, pt.step)
                addr = space.take(delta)
                blocks.append((addr, delta, frames))
                events.append(_event("alloc", addr, delta, frames, pt.time_us))
    segment_blocks: list[Block] = []
    cursor = _BASE
    for addr, size, frames in sorted(b for blocks in live.values() for b in blocks):
        if addr > cursor:
            segment_blocks.append({"address": cursor, "size": addr - cursor, "requested_size": 0,
                                   "state": "inactive", "frames": []})
        segment_blocks.append({"address": addr, "size": size, "requested_size": size,
                               "state": "active_allocated", "frames": frames})
        cursor = addr + size
    if space.end > cursor:
        segment_blocks.append({"address": cursor, "size": space.end - cursor, "requested_size": 0,
                               "state": "inactive", "frames": []})
    segments: list[Segment] = []
    if segment_blocks:
        allocated = sum(b[1] for bl in live.values() for b in bl)
        segments.append({"device": device, "address": _BASE, "total_size": space.end - _BASE, "stream": 0,
                         "segment_type": "large", "allocated_size": allocated, "active_size": allocated,
                         "requested_size": allocated, "blocks": segment_blocks})
    traces: list[list[TraceEntry]] = [[] for _ in range(device + 1)]
    traces[device] = events
    return {"segments": segments, "device_traces": traces, "memprof": {
        "what": "blocks are memprof categories' growth between recorded moments, not single tensors",
        "memprof_version": t.memprof_version, "timed": cv.timed}}


def _event(action: str, addr: int, size: int, frames: list[Frame], time_us: float) -> TraceEntry:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames,
            "time_us": int(time_us)}


#: What an active block that matches no storage memprof knew is called.
UNSEEN = "not seen by memprof"


def attribute_snapshot(trace: "Trace", snapshot: UserObject) -> list[AttributedBlock]:
    """The active blocks of a real ``torch.cuda.memory._snapshot()`` with memprof's category and module.

    The snapshot must be taken while the storages memprof recorded were live: the one written beside an
    OOM dump, or one taken at the moment of an error inside the profile. A block is attributed when its
    address is the address of a storage memprof knew then; the others (cuBLAS and NCCL workspaces,
    tensors made outside the model's run, blocks freed and reused since) are :data:`UNSEEN`.
    """
    from ..errors import InvalidArgumentError, NotMeasuredError

    t = as_trace(trace)
    if not t.live_storages_at_error:
        raise NotMeasuredError(
            "this trace records no live storages to attribute a snapshot with: only a profile that ended in an "
            "error (an OOM dump) records them; profile with oom_dump= and use the snapshot written beside the dump")
    bad = InvalidArgumentError(
        "expected a memory snapshot: the dict torch.cuda.memory._snapshot() returns (segments of blocks with "
        "int addresses and sizes), or the path of its pickle")
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments"), list):
        raise bad
    known = {ptr: (nbytes, cat, module) for ptr, nbytes, cat, module in t.live_storages_at_error}
    rows: list[AttributedBlock] = []
    for seg in snapshot["segments"]:
        if not isinstance(seg, dict) or not isinstance(seg.get("blocks", []), list):
            raise bad
        addr = seg.get("address", 0)
        for block in seg.get("blocks", ()):
            if not isinstance(block, dict):
                raise bad
            here: UserObject  # the snapshot's values, ints (checked below)
            size: UserObject
            here, size = block.get("address", addr), block.get("size", 0)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (here, size)):
                raise bad
            addr = here + size
            if block.get("state") != "active_allocated":
                continue
            cat, module = UNSEEN, None
            if here in known:
                _, cat, module = known[here]
            # As the snapshot gives them: torch's, ints (the device's index).
            requested: UserObject = block.get("requested_size", block.get("size", 0))
            device: UserObject = seg.get("device")
            rows.append({"address": here, "size": size, "requested_size": requested, "category": cat,
                         "module": module or None, "device": device})
    return rows


def read_snapshot(snapshot: UserObject) -> UserObject:
    """``snapshot`` itself, or the snapshot pickled at that path (``str`` or ``os.PathLike``): what
    :func:`attribute_snapshot` takes. A path that holds no pickle is an InvalidArgumentError naming the file."""
    import os
    import pickle

    from ..errors import InvalidArgumentError
    from ..record.files import read_bytes

    if not isinstance(snapshot, (str, os.PathLike)):
        return snapshot
    fix = "give the file torch.cuda.memory._snapshot() was pickled to (memprof writes one beside an OOM dump)"
    try:  # memprof's one reader: a regular file, bounded in size (a pipe or /dev/zero is refused)
        data = read_bytes(snapshot, what="a memory snapshot", fix=fix, error=InvalidArgumentError)
    except FileNotFoundError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise InvalidArgumentError(f"no snapshot at {os.fspath(snapshot)}; {fix}") from None
    try:
        return pickle.loads(data)
    except MemoryError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise InvalidArgumentError(f"{os.fspath(snapshot)} is too large to unpickle in the memory this process may "
                                   "use; give the process more memory") from None
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise InvalidArgumentError(
            f"{os.fspath(snapshot)} is not a pickled memory snapshot ({type(exc).__name__}); {fix}") from None
