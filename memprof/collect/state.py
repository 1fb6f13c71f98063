"""The run state: what every hook reads on every call, pushed by whoever changes it.

One :class:`Run` per profile. Its fields are plain attributes (no properties: a property is a Python call,
and the dispatch mode's handler reads them for every op), each written by one owner:

- the profiler: ``active`` (the block is running and not paused; a schedule's pauses go through the
  ``suspend`` and ``wake`` it wires), ``thread``, ``mode`` and what follows from it;
- the schedule's windows: ``paused``;
- the phase tracker: ``phase``, ``step``, ``scan_args``, ``forward_seen``;
- the dispatch mode's handler: ``ops``;
- the module hooks: ``calls`` (the forward calls in progress) and ``foreign_threads``;
- a layout that finishes its work in a backward callback of its own: ``backward_waits``.

Anyone may append to ``notes`` (what the report should say) and ``changes`` (how the model or its optimizers
changed inside the block). Collectors read the rest and never write it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..vocabulary import Phase

if TYPE_CHECKING:
    import torch

__all__ = ["Run", "EXACT", "LIGHT"]

#: The two ways of measuring: every storage through a dispatch mode, or the allocator's counters and hooks.
EXACT, LIGHT = "exact", "light"


class Run:
    """What the hooks of one profile read: who runs, in which mode, phase and step."""

    __slots__ = ("active", "paused", "thread", "mode", "device", "on_cpu", "timeline", "backward_frames", "phase",
                 "step", "ops", "scan_args", "forward_seen", "calls", "foreign_threads", "backward_waits", "notes",
                 "changes", "source")

    def __init__(self, mode: str, device: "torch.device", timeline: bool, source: str = "dispatch") -> None:
        #: Inside the block and not paused by a schedule: hooks record; otherwise they return at once.
        self.active = False
        #: Between two windows of a schedule: only what counts steps still runs.
        self.paused = False
        #: The thread that started the profile (dispatch modes and saved-tensor hooks are per thread).
        self.thread = 0
        #: ``EXACT`` or ``LIGHT`` (``"auto"`` is decided before a Run is made).
        self.mode = mode
        self.device = device
        self.on_cpu = device.type == "cpu"
        self.timeline = timeline
        # Per-module backward frames measure op-level memory, which only exact mode sees; light mode skips
        # their tensor hooks (backward itself is found by gradient and unpack hooks).
        self.backward_frames = mode == EXACT
        self.phase = Phase.OTHER
        self.step = 0
        self.ops = 0  # ops dispatched so far (exact mode)
        # Ops outside the model's modules are scanned for tensors made before the profile (exact mode).
        self.scan_args = False
        self.forward_seen = False  # a forward began in the step now running
        #: The model's forward calls in progress, innermost last (indices into the module table).
        self.calls: list[int] = []
        #: Threads other than ``thread`` the model ran in, where memprof's per-thread hooks are not installed.
        self.foreign_threads: set[int] = set()
        #: Something queues end-of-backward work that the backward phase must include (FSDP2, a simulated layout).
        self.backward_waits = False
        self.notes: list[str] = []
        self.changes: list[str] = []
        #: Where the record's figures come from: ``"dispatch"`` (exact mode's dispatch mode, or light mode's
        #: counters) or ``"allocator"`` (the allocator's own events; the hooks run as in light mode, with no
        #: dispatch mode).
        self.source = source

    def note(self, text: str) -> None:
        """A note for the report, once."""
        if text not in self.notes:
            self.notes.append(text)
