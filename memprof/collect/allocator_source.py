"""``profile(source="allocator")``: the CUDA caching allocator's own events, reduced per phase.

At every phase boundary (a phase begins, a step ends, the profile ends) the allocator's history since the last
boundary is drained (:mod:`.allocator_history`) and reduced (:mod:`.allocation_events`) with the address of
every storage the profile knows and its category (the ledger's live entries: parameters, gradients, optimizer
states, saved tensors, inputs, caches, communication buffers). Each window becomes an
:class:`AllocatorPhase`: the phase's start, peak, its moment and end as the allocator saw them.

These records stand beside the dispatch mode's, which stay the profile's record: the allocator's events become
exact mode's source where a GPU shows them byte-equal to it and cheaper (``benchmarks/gpu_validate.py
--allocator-source``), which no GPU has shown yet.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..vocabulary import Phase
from .allocation_events import Live, Window, reduce_window
from .ledger import CATEGORY_OF_INDEX
from .state import EXACT, LIGHT

if TYPE_CHECKING:
    import torch

    from .allocator_history import AllocatorHistory
    from .ledger import Ledger
    from .module_table import ModuleTable
    from .phases import PhaseTracker
    from .state import Run
    from .undo import UndoStack

__all__ = ["AllocatorPhase", "AllocatorSource", "known_addresses", "attach", "resolved_mode", "allocator_phases"]


@dataclasses.dataclass(frozen=True)
class AllocatorPhase:
    """One phase as the allocator's events give it: ``step``, ``phase`` (its value) and the reduced window."""

    step: int
    phase: str
    window: Window


def resolved_mode(mode: str, device: "torch.device", source: Any) -> tuple[str, str]:
    """profile()'s ``mode`` with ``"auto"`` decided, and its ``source`` checked. The allocator's events stand
    beside the dispatch mode's, which only exact mode has: ``"auto"`` is exact with them."""
    from . import allocator_history

    source = allocator_history.checked_source(source, device, mode, allocator_history.backend_for(device))
    if mode == "auto":
        mode = EXACT if device.type in ("cpu", "meta") or source == "allocator" else LIGHT
    return mode, source


def allocator_phases(prof: Any) -> "tuple[AllocatorPhase, ...]":
    """With ``source="allocator"``: each phase as the CUDA allocator's own events give it (its start, peak, the
    peak's moment and end by category), in order; empty otherwise."""
    src = prof.collectors.allocator if prof.collectors is not None else None
    return tuple(src.records) if src is not None else ()


def known_addresses(ledger: "Ledger") -> dict[int, list[Any]]:
    """The data address of every storage the ledger holds live: [bytes counted, category value]."""
    out: dict[int, list[Any]] = {}
    for entry in list(ledger.entries.values()):
        storage = entry()
        if storage is None:
            continue
        try:
            addr = storage.data_ptr()
        except RuntimeError:  # a storage without data (fake, meta): nothing the allocator gave
            continue
        if addr:
            out[addr] = [entry.nbytes, CATEGORY_OF_INDEX[entry.cat].value]
    return out


class AllocatorSource:
    """Drains the allocator's history at each phase boundary and keeps one record per window."""

    def __init__(self, run: "Run", ledger: "Ledger", history: "AllocatorHistory") -> None:
        self.run = run
        self.ledger = ledger
        self.history = history
        self.live = Live()
        self.records: list[AllocatorPhase] = []
        self.incomplete = 0
        self.ops = 0  # the run's op count at the last boundary

    def start(self) -> None:
        """What the profile registered so far is what was allocated before the first window."""
        self.live = Live(known_addresses(self.ledger))
        self.ops = self.run.ops
        self.history.start()

    def boundary(self, _phase: "Phase | None" = None) -> None:
        """The phase in progress (the run's phase: a hook of the phase tracker runs before it moves on) ends
        here. Paused by a schedule: the window is dropped with the events it holds."""
        run = self.run
        events, complete = self.history.drain()
        if not run.active:
            self.live = Live(known_addresses(self.ledger))  # what the unwatched steps left
            return
        now = known_addresses(self.ledger)
        known = {addr: v[1] for addr, v in now.items()}
        window = reduce_window(events, self.live, known, rounding=self.ledger.rounding, complete=complete,
                               sizes={addr: v[0] for addr, v in now.items()})
        if not complete:
            self.incomplete += 1
        ops, self.ops = run.ops - self.ops, run.ops
        # The phase tracker keeps no record of an "other" phase in which nothing ran and nothing changed.
        if run.phase is not Phase.OTHER or ops or not window.start == window.peak == window.end:
            self.records.append(AllocatorPhase(run.step, run.phase.value, window))

    def stop(self) -> None:
        """The last window, then the recording stops (a user's goes on)."""
        try:
            if self.history.started:
                self.boundary()
        finally:
            self.history.stop()
        self.run.note(
            f"source='allocator': the allocator's own events were reduced into {len(self.records)} phase "
            "record(s) (prof.allocator_phases), beside the dispatch mode's, which are this record's")
        if self.incomplete:
            self.run.note(
                f"source='allocator': {self.incomplete} phase(s) had more allocator events than the history "
                "keeps: their allocator records are incomplete (complete=False)")


def attach(run: "Run", ledger: "Ledger", phases: "PhaseTracker", table: "ModuleTable", stack: "UndoStack",
           source: str) -> "AllocatorSource | None":
    """On CUDA: with ``source="allocator"``, record the allocator's history and reduce it per phase; whenever
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
        phases.on_step_end.append(src.boundary)
        phases.on_begin.append(src.boundary)
    if backend.labels() and backend.enabled():
        labels = SnapshotLabels(run, table, backend.get_metadata, backend.set_metadata)
        labels.start(stack)
        phases.on_step_end.append(labels.step_ended)
        phases.on_begin.append(labels.phase_began)
    return src


def _current_device() -> int:
    import torch

    return torch.cuda.current_device()
