"""``profile(source="allocator")``: exact mode's figures from the CUDA caching allocator's own events, with no
dispatch mode.

The profile runs the hooks light mode runs (modules, saved tensors, gradients, optimizer steps; no Python per op),
and they tell the ledger which storage is what: parameters and buffers, gradients, optimizer states, saved
activations, inputs, caches, communication buffers. When a phase closes, the allocator's history since the last
close is drained (:mod:`.allocator_history`) and reduced (:mod:`.allocation_events`) with the address and
category of each of those storages (``untyped_storage().data_ptr()``); every block nobody claims is a temporary.
The phase's record (start, peak, end) is that window's, and so are the record's start, peak and end.

What it assumes: a storage's category is the one the hooks know at the window's end (a temporary that a later op
of the same phase saves for backward is an activation at the peak too); temporaries are the allocator's blocks
no hook claims (workspaces taken inside an op among them, which a dispatch mode does not see).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..errors import InvalidArgumentError, is_interrupt
from ..vocabulary import Phase
from .allocation_events import Live, Window, reduce_window
from .ledger import CATEGORY_OF_INDEX
from .phase_records import window_breakdown
from .state import EXACT, LIGHT

if TYPE_CHECKING:
    import torch

    from ..record.parts import StepRecord
    from ..record.trace import Breakdown

    from .aliases import Row
    from .allocation_events import TraceEntry
    from .allocator_history import AllocatorHistory
    from .device import DeviceReading
    from .ledger import Ledger
    from .module_table import ModuleTable
    from .phases import PhaseTracker
    from .state import Run
    from .undo import UndoStack

__all__ = ["AllocatorPhase", "AllocatorSource", "known_addresses", "attach", "resolved_mode",
           "NOTE"]

#: What the record says about where its figures come from and what that assumes.
NOTE = ("source='allocator': every phase's start, peak and end are reduced from the CUDA caching allocator's own "
        "events (no dispatch mode ran); a storage's category is the one the hooks knew at the end of its phase "
        "(a temporary a later op of the phase saved for backward counts as an activation at the peak too), and "
        "temporaries are the allocator's blocks that no parameter, buffer, gradient, optimizer state, saved "
        "tensor, input or cache claims (workspaces taken inside an op among them); per-module op-level memory "
        "is not measured")


@dataclasses.dataclass(frozen=True)
class AllocatorPhase:
    """One phase as the allocator's events give it: ``step``, ``phase`` (its value) and the reduced window."""

    step: int
    phase: str
    window: Window


def resolved_mode(mode: str, device: "torch.device", source: object, schedule: object = None) -> tuple[str, str]:
    """profile()'s ``mode`` with ``"auto"`` decided, and its ``source`` checked. With the allocator's events the
    hooks run as light mode's (no dispatch mode): the run's mode is light, the record's exact."""
    from . import allocator_history

    source = allocator_history.checked_source(source, device, mode, allocator_history.backend_for(device))
    if source == "allocator":
        if schedule is not None:
            raise InvalidArgumentError(
                "source='allocator' reduces every phase from the allocator's events, and a schedule's pauses would "
                "leave windows without them; profile without schedule=, or with source='dispatch'")
        return LIGHT, source
    if mode == "auto":
        mode = EXACT if device.type in ("cpu", "meta") else LIGHT
    return mode, source


def known_addresses(ledger: "Ledger") -> "dict[int, Row]":
    """The data address of every storage the ledger holds live: [bytes counted, category value]."""
    out: "dict[int, Row]" = {}
    ledger.settle()
    for entry in list(ledger.entries.values()):
        storage = entry()
        if storage is None:
            continue
        try:
            addr = storage.data_ptr()
        except RuntimeError as failure:  # a storage without data (fake, meta): nothing the allocator gave
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            continue
        if addr:
            out[addr] = [entry.nbytes, CATEGORY_OF_INDEX[entry.cat].value]
    return out


class AllocatorSource:
    """Drains the allocator's history when a phase closes and reduces it: each phase's record."""

    def __init__(self, run: "Run", ledger: "Ledger", history: "AllocatorHistory") -> None:
        self.run = run
        self.ledger = ledger
        self.history = history
        self.live = Live()
        self.records: list[AllocatorPhase] = []
        self.incomplete = 0
        self.pending: "list[TraceEntry]" = []  # drained when the recording stopped, for the last window
        self.pending_complete = True
        #: The highest peak of the run: (its total, the breakdown, step, phase value).
        self.top: "tuple[int, Breakdown, int, str] | None" = None
        self.first: "Breakdown | None" = None
        #: The steps the record keeps in full (the phase tracker's retention): the windows of the others are dropped
        #: once there are more than ``bound``.
        self.kept: "dict[int, StepRecord] | None" = None
        self.bound = 256

    def start(self) -> None:
        """What the profile registered so far is what was allocated before the first window."""
        self.live = Live(known_addresses(self.ledger))
        self.history.start()

    def _events(self) -> "tuple[list[TraceEntry], bool]":
        events, complete = self.pending, self.pending_complete
        self.pending, self.pending_complete = [], True
        if self.history.started:
            more, ok = self.history.drain()
            events, complete = events + more, complete and ok
        return events, complete

    def close_window(self) -> "Window | None":
        """The phase in progress (the run's) closes: its window, or None for an "other" phase in which nothing
        was allocated (the phase tracker keeps no record of it)."""
        run = self.run
        events, complete = self._events()
        now = known_addresses(self.ledger)
        window = reduce_window(events, self.live, {addr: v[1] for addr, v in now.items()},
                               rounding=self.ledger.rounding, complete=complete,
                               sizes={addr: v[0] for addr, v in now.items()})
        if run.phase is Phase.OTHER and window.start == window.peak == window.end:
            return None
        if not complete:
            self.incomplete += 1
        self.records.append(AllocatorPhase(run.step, run.phase.value, window))
        if self.kept is not None and len(self.records) > self.bound:
            # Bounded however long the run: the windows of the steps the record keeps in full, and this step's.
            kept = self.kept
            self.records = [r for r in self.records if r.step == run.step or r.step in kept]
            self.bound = max(self.bound, 2 * len(self.records))
        if self.first is None:
            self.first = window.start
        total = window.peak.total or 0
        if self.top is None or total > self.top[0]:
            self.top = (total, window.peak, run.step, run.phase.value)
        return window

    def peak_step(self) -> "int | None":
        """The step that held the highest phase peak so far (the report keeps that step in full)."""
        return self.top[2] if self.top is not None else None

    def stop(self) -> None:
        """What the recording holds is kept for the last window, then the recording stops (a user's goes on)."""
        try:
            if self.history.started:
                self.pending, self.pending_complete = self._events()
        finally:
            self.history.stop()
        self.run.note(NOTE)
        if self.incomplete:
            self.run.note(
                f"source='allocator': {self.incomplete} phase(s) had more allocator events than the history "
                "keeps: their records are incomplete (complete=False), not a measurement")

    def figures(self, device_end: "DeviceReading | None", device_peak: "DeviceReading | None"
                ) -> "tuple[Breakdown, Breakdown, Breakdown, int, str] | None":
        """The run's start, peak and end as the windows give them (with the device's figures at the peak and
        the end), and the peak's step and phase value; None when no window was kept."""
        if self.top is None or self.first is None:
            return None
        end = self.records[-1].window.end
        return (window_breakdown(self.first, "start", None), window_breakdown(self.top[1], "peak", device_peak),
                window_breakdown(end, "end", device_end), self.top[2], self.top[3])


def attach(run: "Run", ledger: "Ledger", phases: "PhaseTracker", table: "ModuleTable", stack: "UndoStack",
           source: str) -> "AllocatorSource | None":
    """On CUDA: with ``source="allocator"``, record the allocator's history and reduce each phase from it (the
    phase tracker's records are those windows); whenever
    the history is recorded (memprof's, or the user's already), label its entries with memprof's phase, step
    and module. Everything started goes on ``stack``."""
    from . import allocator_history
    from .allocator_history import AllocatorHistory
    from .snapshot_labels import SnapshotLabels

    backend = allocator_history.backend_for(run.device)
    if backend is None:
        return None
    src = None
    if source == "allocator":
        index = run.device.index if run.device.index is not None else \
            _current_device() if run.device.type == "cuda" else 0
        src = AllocatorSource(run, ledger, AllocatorHistory(backend, index))
        stack.callback(src.stop)
        src.start()
        phases.window_source = src
        src.kept = phases.retention.kept
    if backend.labels() and backend.enabled():
        labels = SnapshotLabels(run, table, backend.get_metadata, backend.set_metadata)
        labels.start(stack)
        phases.on_step_end.append(labels.step_ended)
        phases.on_begin.append(labels.phase_began)
    return src


def _current_device() -> int:
    import torch

    return torch.cuda.current_device()
