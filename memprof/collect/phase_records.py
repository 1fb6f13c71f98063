"""What the phase machine writes down: a phase's record as it closes, the steps kept or forgotten, the record
at the end.

Each runs once per phase or step (never per op), a function of the :class:`~.phases.PhaseTracker` whose
fields it reads and writes (:class:`PhaseBook` names them, so that this module imports no phase tracker): the
phases closed in the step under way (``step_phases``, ``occurrence``, ``closed``), where each phase is in the
ledger (``where``) and the steps kept (``retention``).
"""

from __future__ import annotations

import dataclasses
from time import perf_counter_ns
from typing import TYPE_CHECKING, Callable, Literal, Protocol

from . import marks
from ..vocabulary import Phase
from ..record.trace import PhaseRecord, StepRecord
from .ledger import CATEGORY_OF_INDEX, breakdown, tag_pairs
from .retention import Retention
from .state import LIGHT

if TYPE_CHECKING:
    from ..record.trace import Breakdown
    from .allocation_events import Window
    from .device import DeviceProbe, DeviceReading
    from .ledger import Ledger
    from .state import Run
    from .timeline import Timeline

__all__ = ["Gate", "WindowSource", "PhaseBook", "close_phase", "keep", "forget_steps", "finish", "window_breakdown"]


class Gate(Protocol):
    """What a schedule decides about the steps (:class:`memprof.collect.windows.Windows`)."""

    def records_now(self) -> bool:
        """Is the step running now one the schedule records (not a warmup step)?"""

    def step_closed(self, index: int) -> None:
        """A watched step closed: the schedule may end a window or pause."""

    def note_recorded(self, index: int) -> None:
        """Step ``index`` is in the record."""

    def forget(self, index: int) -> None:
        """Step ``index`` was a warmup step: it leaves no trace in the record."""

    def ended_while_paused(self) -> bool:
        """Did a step end since the schedule paused (forgotten once asked)?"""


class WindowSource(Protocol):
    """Where the phases' figures come from instead of the ledger (:class:`.allocator_source.AllocatorSource`)."""

    def close_window(self) -> "Window | None":
        """The phase in progress closes: its window (None: one that leaves no record)."""

    def peak_step(self) -> "int | None":
        """The step that held the highest peak so far."""


class PhaseBook(Protocol):
    """What these functions read and write of the phase tracker (:class:`~.phases.PhaseTracker` says what
    each field holds)."""

    ledger: "Ledger"
    run: "Run"
    probe: "DeviceProbe"
    timeline: "Timeline"
    gate: "Gate | None"
    window_source: "WindowSource | None"
    retention: Retention
    step_phases: list[PhaseRecord]
    occurrence: dict[Phase, int]
    closed: dict[int, int]
    where: dict[int, tuple[int, Phase]]
    phase_start: list[int]
    phase_start_ns: int
    phase_ops_start: int
    end_mark: "list[int] | None"
    encoder_open: bool
    before_close: Callable[[], bool]
    on_close: list[Callable[[int, Phase, int], None]]


def close_phase(tracker: PhaseBook) -> None:
    """Record the phase that is ending (an "other" phase in which nothing happened leaves none), and tell the
    collectors that act as it closes (``on_close``)."""
    led, run = tracker.ledger, tracker.run
    led.settle()  # what torch released before the boundary: the phase's end
    if tracker.encoder_open:
        _encoder_alone(tracker)
    phase = run.phase
    end = led.totals
    ops = run.ops - tracker.phase_ops_start
    # None: no record; False: the ledger's figures (no allocator window).
    window: "Window | None | Literal[False]" = (
        tracker.window_source.close_window() if tracker.window_source is not None else False)
    if window is None or (window is False and phase is Phase.OTHER and ops == 0 and end == tracker.phase_start
                          and led.phase_peak == tracker.phase_start):
        return
    occ = tracker.occurrence.get(phase, 0)
    tracker.occurrence[phase] = occ + 1
    if tracker.end_mark is not None and phase is Phase.DECODE:
        end = tracker.end_mark  # a merged decode phase ends where its last call did
    if led.moments is not None:  # a kept allocation stream
        marks.note_moment(led, run.step, marked=end is tracker.end_mark)
    tracker.end_mark = None
    tracker.closed[led.phase_serial] = len(tracker.step_phases)
    device_now = tracker.probe.phase_ended()
    light = tracker.before_close() or run.mode == LIGHT  # a carried optimizer step that raised: as in light mode
    micros = tracker.timeline.micros
    start, peak, last = _figures(window or None, (tracker.phase_start, led.phase_peak, end), light, device_now)
    tracker.step_phases.append(PhaseRecord(
        step=run.step, phase=phase, occurrence=occ, start=start, peak=peak, end=last,
        ops=ops,
        tags_peak=tag_pairs(led.phase_peak_tags),
        tags_end=tag_pairs(led.tag_act),
        start_us=micros(tracker.phase_start_ns),
        peak_us=micros(led.phase_peak_ns),
        end_us=micros(perf_counter_ns()),
    ))
    for hook in tracker.on_close:
        hook(run.step, phase, occ)


def keep(tracker: PhaseBook, rec: StepRecord, *, selected: bool = False) -> None:
    """A step ended: into the statistics, and into the detail while retention keeps it (or a schedule chose it)."""
    src = tracker.window_source  # the allocator's windows know the peak; the ledger's is light mode's then
    peak = (src.peak_step(),) if src is not None else tracker.where.get(tracker.ledger.peak_phase_serial)
    dropped = tracker.retention.add(rec, peak_step=peak[0] if peak else None, selected=selected)
    if dropped:
        forget_steps(tracker, set(dropped))


def forget_steps(tracker: PhaseBook, gone: "set[int]") -> None:
    """These steps leave the record: their samples, and where their phases were (but the peak's)."""
    tracker.timeline.forget_steps(gone)
    peak_serial = tracker.ledger.peak_phase_serial
    tracker.where = {serial: w for serial, w in tracker.where.items() if w[0] not in gone or serial == peak_serial}


def finish(tracker: PhaseBook) -> list[StepRecord]:
    """Close whatever is open; a trailing step holding only "other" joins the previous step."""
    gate = tracker.gate
    if gate is not None and tracker.run.paused:
        # Nothing was watched since the pause: what the ledger saw then (frees) is no phase's.
        tracker.step_phases = []
        if gate.ended_while_paused():
            tracker.retention.steps_run += 1
        return tracker.retention.records()
    close_phase(tracker)
    phases = tracker.step_phases
    step = tracker.run.step
    last = tracker.retention.kept.get(step - 1)
    if phases:
        tail = all(p.phase is Phase.OTHER for p in phases)
        if tail and last is not None:
            _join_last(tracker.retention, last, phases)
        elif tail and step > 0 and gate is not None:
            # The tail of a schedule's warmup step, closed early by end_step() (a callback at the step's
            # end): forgotten with that step, never a step of its own that did not run.
            gate.forget(step)
        elif gate is None or gate.records_now():
            keep(tracker, StepRecord(step, tuple(phases)), selected=gate is not None)
            if gate is not None:
                gate.note_recorded(step)
        else:
            tracker.retention.steps_run += 1
    tracker.step_phases = []
    return tracker.retention.records()


def _encoder_alone(tracker: PhaseBook) -> None:
    """No decoder call followed the encoder: the phase it began was a forward of the encoder alone."""
    tracker.encoder_open = False
    tracker.run.phase = Phase.FORWARD
    tracker.where[tracker.ledger.phase_serial] = (tracker.run.step, Phase.FORWARD)


def _figures(window: "Window | None", totals: tuple[list[int], list[int], list[int]], light: bool,
             device: "DeviceReading | None") -> "tuple[Breakdown, Breakdown, Breakdown]":
    """A phase's start, peak and end: the allocator's window (every tensor category measured), or the ledger's."""
    if window is not None:
        return (window_breakdown(window.start, "start", device), window_breakdown(window.peak, "peak", device),
                window_breakdown(window.end, "end", device))
    return (breakdown(totals[0], light=light, where="start", device=device),
            breakdown(totals[1], light=light, where="peak", device=device),
            breakdown(totals[2], light=light, where="end", device=device))


def window_breakdown(bd: "Breakdown", where: str, device: "DeviceReading | None") -> "Breakdown":
    """A window's breakdown with the device's figures (allocator overhead, memory outside torch) added."""
    return breakdown([bd[c.value] or 0 for c in CATEGORY_OF_INDEX], light=False, where=where, device=device)


def _join_last(retention: Retention, last: StepRecord, phases: "list[PhaseRecord]") -> None:
    """A trailing step holding only "other" phases: they join the last kept step, numbered after its own."""
    extra = tuple(dataclasses.replace(p, step=last.index, occurrence=p.occurrence + sum(
        1 for q in last.phases if q.phase is p.phase)) for p in phases)
    retention.replace_last(StepRecord(last.index, last.phases + extra))
    retention.add_phases(extra)
