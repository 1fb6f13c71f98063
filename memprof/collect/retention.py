"""What a long run keeps: full detail for a few steps, statistics for all of them.

Memory held by a profile must not grow with the number of steps. Each step
that ends is added to per-phase statistics (count, min, median, max of every
category at the phase's peak and end) and kept in full only while it is one of
the first :data:`FIRST_STEPS`, the step that holds the peak so far, the last
step, or a step a schedule selected (at most :data:`MAX_SELECTED` of those,
the most recent).
"""

from __future__ import annotations

from typing import Iterable

from ..vocabulary import Phase
from ..record.stats import STAT_KEYS, PhaseStats, Stat
from ..record.trace import Breakdown, PhaseRecord, StepRecord

__all__ = ["Retention", "FIRST_STEPS", "MAX_SELECTED"]

#: Steps kept in full from the start of the run.
FIRST_STEPS = 3
#: Steps a schedule selected that stay in full; older ones leave the detail, not the statistics.
MAX_SELECTED = 256
# A series keeps every distinct value (exact median) up to this many, then an evenly thinned sample.
_DISTINCT = 64
_SAMPLE = 64
# Steps whose phase figures wait to be folded into the series (memory stays bounded: two records a step).
_ROWS = 64


class _Series:
    """Count, min, max and median of a stream of ints (``None``: not measured, counted apart)."""

    __slots__ = ("n", "lo", "hi", "counts", "sample", "every", "since", "missing")

    def __init__(self) -> None:
        self.n = 0
        self.lo = self.hi = 0
        self.counts: "dict[int, int] | None" = {}
        self.sample: list[int] = []
        self.every = 1  # once thinned: one value in ``every`` joins the sample
        self.since = 0
        self.missing = 0

    def add(self, value: "int | None") -> None:
        if value is None:
            self.missing += 1
            return
        if self.n == 0 or value < self.lo:
            self.lo = value
        if self.n == 0 or value > self.hi:
            self.hi = value
        self.n += 1
        counts = self.counts
        if counts is not None:
            counts[value] = counts.get(value, 0) + 1
            if len(counts) > _DISTINCT:
                self._thin_from_counts()
            return
        self.since += 1
        if self.since >= self.every:
            self.since = 0
            self.sample.append(value)
            if len(self.sample) >= 2 * _SAMPLE:
                self.sample = self.sample[::2]
                self.every *= 2

    def _thin_from_counts(self) -> None:
        # Every ``every``-th element of the sorted multiset the counts describe: an even sample of the
        # values so far, in which each value keeps its share (a rare one may drop out, as it should).
        counts, self.counts = self.counts or {}, None
        every = self.every = max(1, -(-self.n // _SAMPLE))
        offset, start, sample = every // 2, 0, []
        for value, c in sorted(counts.items()):
            first = start + (offset - start) % every
            if first < start + c:
                sample.extend([value] * ((start + c - 1 - first) // every + 1))
            start += c
        self.sample = sample

    def stat(self) -> "Stat | None":
        if self.n == 0 or self.missing:  # any phase that did not measure it: the figure is not measured
            return None
        if self.counts is not None:
            middle, seen = (self.n + 1) // 2, 0
            for value in sorted(self.counts):
                seen += self.counts[value]
                if seen >= middle:
                    return Stat(self.lo, value, self.hi)
        ordered = sorted(self.sample)
        return Stat(self.lo, ordered[(len(ordered) - 1) // 2], self.hi)


class _PhaseSeries:
    """The series of one phase's peak and end figures. A step's figures wait in :attr:`rows` (at most
    :data:`_ROWS` steps) and are folded into the series in one pass, in the order they came: a step's end
    costs one append, not two dozen series updates made between its first ops and the next step's."""

    __slots__ = ("count", "_peak", "_end", "rows")

    def __init__(self) -> None:
        self.count = 0
        self._peak = [_Series() for _ in STAT_KEYS]
        self._end = [_Series() for _ in STAT_KEYS]
        self.rows: list[tuple[Breakdown, Breakdown]] = []

    def add(self, peak: Breakdown, end: Breakdown) -> None:
        self.count += 1
        rows = self.rows
        rows.append((peak, end))
        if len(rows) >= _ROWS:
            self.fold()

    def fold(self) -> None:
        rows, self.rows = self.rows, []
        for peak, end in rows:
            for series, bd in ((self._peak, peak), (self._end, end)):
                for s, v in zip(series, bd.counts + (bd.total,)):
                    s.add(v)

    @property
    def peak(self) -> list[_Series]:
        self.fold()
        return self._peak

    @property
    def end(self) -> list[_Series]:
        self.fold()
        return self._end


class Retention:
    """The steps kept in full, and the statistics of every step."""

    def __init__(self) -> None:
        self.kept: dict[int, StepRecord] = {}
        self.selected: list[int] = []  # steps a schedule selected, oldest first
        self.steps_run = 0
        self._stats: dict[tuple[Phase, int], _PhaseSeries] = {}

    def add(self, rec: StepRecord, *, peak_step: "int | None", selected: bool = False) -> list[int]:
        """Count a step that ended; return the indices of steps that leave the detail now."""
        self.steps_run += 1
        self.add_phases(rec.phases)
        self.kept[rec.index] = rec
        if selected:
            self.selected.append(rec.index)
            if len(self.selected) > MAX_SELECTED:
                del self.selected[0]
        keep = set(self.selected)
        dropped = [i for i in self.kept
                   if i >= FIRST_STEPS and i != peak_step and i != rec.index and i not in keep]
        for i in dropped:
            del self.kept[i]
        return dropped

    def add_phases(self, phases: Iterable[PhaseRecord]) -> None:
        stats = self._stats
        for p in phases:
            key = (p.phase, p.occurrence)
            series = stats.get(key)
            if series is None:
                series = stats[key] = _PhaseSeries()
            series.add(p.peak, p.end)

    def replace_last(self, rec: StepRecord) -> None:
        """The last step grew (a trailing "other" phase joined it at the end of the profile)."""
        self.kept[rec.index] = rec

    def records(self) -> list[StepRecord]:
        return [self.kept[i] for i in sorted(self.kept)]

    def phase_stats(self) -> tuple[PhaseStats, ...]:
        order = {Phase.PREFILL: 0, Phase.DECODE: 1, Phase.FORWARD: 2, Phase.BACKWARD: 3, Phase.OPTIMIZER: 4,
                 Phase.OTHER: 5}
        out = []
        for (phase, occ), s in sorted(self._stats.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
            peak = tuple(zip(STAT_KEYS, (x.stat() for x in s.peak)))
            end = tuple(zip(STAT_KEYS, (x.stat() for x in s.end)))
            exact = all(x.counts is not None for x in s.peak + s.end)
            out.append(PhaseStats(phase, occ, s.count, peak, end, exact))
        return tuple(out)
