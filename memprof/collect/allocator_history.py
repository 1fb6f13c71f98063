"""The CUDA caching allocator's event history, read window by window: started for a profile (or a user's own
recording kept), drained at each phase boundary, stopped and restored at the end.

The allocator records each alloc and free in C++ while ``torch.cuda.memory._record_memory_history`` is on,
into a ring buffer of ``max_entries`` entries (c10/cuda/CUDACachingAllocator.cpp, ``record_trace``);
``torch.cuda.memory._snapshot()`` returns it. memprof records without stack traces (``context=None``: torch's
docstring puts an entry with stacks at several KB) and, when the recording is its own, clears the buffer after
each drain (``clear_history=True``: ``recordHistory`` empties the buffer), so that what it holds is bounded by
one phase's events.

A user who already records keeps the recording as it was: memprof never restarts, clears or stops it, and
finds the entries that are new since the last drain after the last one it read (a buffer that wrapped past
that entry marks the window incomplete). Everything torch-specific goes through a :class:`Backend`, so that the
logic is tested on CPU with a stand-in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

import torch

from ..errors import InvalidArgumentError
from . import torch_compat

if TYPE_CHECKING:
    from .allocation_events import Snapshot, TraceEntry

__all__ = ["Backend", "TorchBackend", "AllocatorHistory", "MAX_ENTRIES", "SOURCES", "checked_source",
           "backend_for"]

#: The entries memprof's own recording keeps per window (a phase); a phase with more is marked incomplete.
MAX_ENTRIES = 200_000
#: Where exact mode's allocation events come from.
SOURCES = ("dispatch", "allocator")


class Backend(Protocol):
    """What memprof asks of the allocator's history (torch's private functions, :mod:`.torch_compat`)."""

    def enabled(self) -> bool:
        """Is the history recorded now?"""

    def labels(self) -> bool:
        """Can entries carry a metadata string (:meth:`set_metadata`)?"""

    def record(self, enabled: 'Literal["state", "all"] | None', **options: object) -> None:
        """``torch.cuda.memory._record_memory_history(enabled, **options)``."""

    def snapshot(self) -> Snapshot:
        """``torch.cuda.memory._snapshot()``."""

    def get_metadata(self) -> str:
        """The string attached to entries recorded from now on."""

    def set_metadata(self, text: str) -> None:
        """Attach ``text`` to the entries recorded from now on (``""`` clears it)."""


class TorchBackend:
    """The CUDA caching allocator of this process."""

    def enabled(self) -> bool:
        probe = torch_compat.cuda_history_enabled
        return bool(probe()) if probe is not None else False

    def labels(self) -> bool:
        return torch_compat.set_cuda_metadata is not None and torch_compat.get_cuda_metadata is not None

    def record(self, enabled: 'Literal["state", "all"] | None', **options: object) -> None:
        torch_compat.record_cuda_history(enabled, **options)

    def snapshot(self) -> Snapshot:
        return torch_compat.cuda_memory_snapshot().copy()

    def get_metadata(self) -> str:
        get = torch_compat.get_cuda_metadata
        return get() if get is not None else ""

    def set_metadata(self, text: str) -> None:
        if torch_compat.set_cuda_metadata is not None:
            torch_compat.set_cuda_metadata(text)


def backend_for(device: torch.device) -> "Backend | None":
    """The allocator history of ``device``: this process's CUDA caching allocator on a CUDA device (where torch
    has one), else None. Tests replace this function with one that returns a stand-in."""
    if device.type != "cuda" or torch_compat.cuda_history_enabled is None:
        return None
    return TorchBackend()


def checked_source(source: object, device: torch.device, mode: str, backend: "Backend | None") -> str:
    """``source=`` of profile(), checked: the allocator's events exist only on CUDA (``backend``: the device's
    allocator history, None without one), for exact mode."""
    if not isinstance(source, str) or source not in SOURCES:
        raise InvalidArgumentError(f"source must be one of {', '.join(repr(s) for s in SOURCES)}, got {source!r}")
    if source == "allocator" and backend is None:
        raise InvalidArgumentError(
            f"source='allocator' reads the CUDA caching allocator's own events, and the model is on "
            f"{device.type}{'' if torch_compat.cuda_history_enabled is not None else ' (this torch has no CUDA)'}"
            "; profile a model on a CUDA device, or leave source='dispatch' (the default, exact on every "
            "device)")
    if source == "allocator" and mode == "light":
        raise InvalidArgumentError(
            "source='allocator' is a source of exact mode's events; use mode='exact' (or 'auto') with it, or "
            "mode='light' without it")
    return source


#: What tells an entry from the others: its action, address, size and time.
_Key = tuple["str | None", "int | None", "int | None", "int | None"]


def _key(entry: "TraceEntry") -> _Key:
    return (entry.get("action"), entry.get("addr"), entry.get("size"), entry.get("time_us"))


class AllocatorHistory:
    """One profile's reading of the allocator's history, on device ``index``."""

    def __init__(self, backend: Backend, index: int, max_entries: int = MAX_ENTRIES) -> None:
        self.backend = backend
        self.index = index
        self.max_entries = max_entries
        #: The recording was the user's (kept untouched), or memprof's (stopped at the end).
        self.users = False
        self.started = False
        self._last: "_Key | None" = None  # the last entry read from a user's recording

    def _options(self) -> dict[str, object]:
        # No stack traces: they cost kilobytes per entry and a Python frame walk per allocation.
        return {"context": None, "stacks": "python", "max_entries": self.max_entries, "clear_history": True}

    def start(self) -> None:
        """Record from now on (or keep the user's recording, read from its current end)."""
        if self.backend.enabled():
            self.users = True
            entries = self._entries()
            self._last = _key(entries[-1]) if entries else None
        else:
            self.backend.record("all", **self._options())
        self.started = True

    def _entries(self) -> "list[TraceEntry]":
        traces = self.backend.snapshot().get("device_traces") or []
        return list(traces[self.index]) if self.index < len(traces) else []

    def drain(self) -> "tuple[list[TraceEntry], bool]":
        """The entries recorded since the last drain (or the start), in order, and whether they are all there
        (False when the buffer may have dropped some)."""
        entries = self._entries()
        if not self.users:
            # Memprof's own buffer: everything in it is new; clearing it bounds the next window.
            self.backend.record("all", **self._options())
            return entries, len(entries) < self.max_entries
        last = self._last
        if entries:
            self._last = _key(entries[-1])
        if last is None:
            return entries, True
        for i in range(len(entries) - 1, -1, -1):
            if _key(entries[i]) == last:
                return entries[i + 1:], True
        return entries, False  # the user's ring buffer wrapped past the last entry read

    def stop(self) -> None:
        """Stop memprof's own recording (a user's goes on as it was)."""
        if self.started and not self.users:
            self.started = False
            self.backend.record(None)
