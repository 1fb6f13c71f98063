"""The memory curve of a run: every recorded moment in time order, for the exports and the SVG timeline.

A trace holds two kinds of moments: each phase's start, peak and end (always), and the timeline's
samples at module and phase boundaries (``timeline=True``, the default). Merged and ordered by time
they give the curve the Chrome/Perfetto counters, the memory_viz blocks and the HTML timeline draw.
A phase's peak is among them, so no curve misses a peak that a sample fell either side of.

Traces written before schema 4 carry no times: their phases are laid out one after another, 1 ms
each (start, peak at its middle, end), their samples are left out, and :attr:`Curve.timed` is False so
that every export can say its time axis is the order of phases, not a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..vocabulary import Phase
from ..record.trace import Breakdown, PhaseRecord

if TYPE_CHECKING:
    from ..record.trace import Trace

__all__ = ["Point", "Curve", "curve", "phase_times", "level"]

#: Microseconds given to each phase of a trace without times.
_UNTIMED_PHASE_US = 1000.0


@dataclass(frozen=True)
class Point:
    """One moment: when, where in the run, and the composition of memory then."""

    time_us: float
    step: int
    phase: Phase
    #: "start", "peak" or "end" of a phase; "enter" or "exit" of ``module``; "phase" and "start" samples.
    kind: str
    #: The module whose boundary this is ("enter"/"exit"), else None.
    module: "str | None"
    breakdown: Breakdown


@dataclass(frozen=True)
class Curve:
    points: tuple[Point, ...]
    #: Whether the times come from the clock (schema 4 and later) or from the order of phases.
    timed: bool


def level(bd: Breakdown) -> int:
    """A moment's height: what was measured of it, summed (its total where there is one; light mode on a
    CPU measures no total, and its height is then the categories it did measure)."""
    return sum(bd.measured().values())


def phase_times(trace: "Trace") -> list[tuple[PhaseRecord, float, float, float]]:
    """Each kept phase with its start, peak and end in microseconds (synthetic for untimed traces)."""
    out = []
    for i, p in enumerate(trace.phases):
        if p.start_us is not None and p.peak_us is not None and p.end_us is not None:
            # The peak was taken between start and end; clamp against clock rounding.
            peak = min(max(p.peak_us, p.start_us), p.end_us)
            out.append((p, p.start_us, peak, p.end_us))
        else:
            base = i * _UNTIMED_PHASE_US
            out.append((p, base, base + _UNTIMED_PHASE_US / 2, base + _UNTIMED_PHASE_US - 1))
    return out


def curve(trace: "Trace") -> Curve:
    """Every recorded moment of ``trace`` in time order (see the module's docstring)."""
    timed = bool(trace.phases) and all(p.start_us is not None for p in trace.phases)
    order = {"start": 0, "phase": 1, "enter": 2, "peak": 3, "exit": 4, "end": 5}
    points = []
    for p, start, peak, end in phase_times(trace):
        points.append(Point(start, p.step, p.phase, "start", None, p.start))
        points.append(Point(peak, p.step, p.phase, "peak", None, p.peak))
        points.append(Point(end, p.step, p.phase, "end", None, p.end))
    if timed:
        for s in trace.timeline:
            if s.time_us is None:
                continue
            module = s.label if s.event in ("enter", "exit") else None
            points.append(Point(s.time_us, s.step, s.phase, s.event or "phase", module, s.breakdown))
    points.sort(key=lambda pt: (pt.time_us, order.get(pt.kind, 9)))
    return Curve(tuple(points), timed)
