"""Per-phase statistics over every step of a run: the part of the record that does not grow.

A long run keeps full detail (a :class:`~memprof.record.trace.StepRecord` with its
breakdowns) for a few steps only; every step, kept or not, adds to one
:class:`PhaseStats` per (phase, occurrence): how many there were, and the
smallest, the median and the largest bytes of each category at the phase's
peak and at its end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence

from ..vocabulary import Category, Phase
from . import fields as fileform
from .checks import corrupt, optional_count
from .aliases import JSONObject
from .fields import form

if TYPE_CHECKING:
    from .parts import Breakdown

__all__ = ["Stat", "PhaseStats", "STAT_KEYS", "series_from"]

#: The series a PhaseStats holds at each moment: the categories' values, then "total".
STAT_KEYS: tuple[str, ...] = tuple(c.value for c in Category) + ("total",)


class Stat(NamedTuple):
    """Smallest, median and largest bytes of one category over the phases counted."""

    min: int
    median: int
    max: int


@dataclass(frozen=True)
class PhaseStats:
    """One kind of phase (``phase``, ``occurrence``) over every step of the run.

    ``peak`` and ``end`` map each category (and ``"total"``) to its :class:`Stat`, or to
    ``None`` when that figure was not measured. ``median_exact`` is False when the values
    were too varied to keep them all: the median is then that of an evenly thinned sample.
    """

    phase: Phase = field(metadata=form(label="a phase statistic's phase"))
    occurrence: int = field(metadata=form(label="occurrence"))
    count: int = field(metadata=form(label="a phase count"))
    # A mapping of each series to [min, median, max] or null in the file, every series of STAT_KEYS in order.
    peak: tuple[tuple[str, "Stat | None"], ...] = field(metadata=form(read=lambda v, _: _stats(v),
                                                                       write=lambda v: _stats_dict(v)))
    end: tuple[tuple[str, "Stat | None"], ...] = field(metadata=form(read=lambda v, _: _stats(v),
                                                                      write=lambda v: _stats_dict(v)))
    median_exact: bool = field(default=True, metadata=form(label="median_exact"))

    def at(self, moment: str, key: "Category | str") -> "Stat | None":
        """The Stat of ``key`` (a category or ``"total"``) at ``"peak"`` or ``"end"``."""
        name = key.value if isinstance(key, Category) else str(key)
        return dict(self.peak if moment == "peak" else self.end).get(name)

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "PhaseStats":
        return fileform.read(cls, data, "a phase statistic")


def _stats_dict(series: tuple[tuple[str, "Stat | None"], ...]) -> JSONObject:
    return {k: list(v) if v is not None else None for k, v in series}


def _stats(data: object) -> tuple[tuple[str, "Stat | None"], ...]:
    if not isinstance(data, Mapping):
        raise corrupt("phase statistics must map categories to [min, median, max]")
    out: list[tuple[str, Stat | None]] = []
    for key in STAT_KEYS:
        value = data.get(key)
        if value is None:
            out.append((key, None))
            continue
        if not isinstance(value, list) or len(value) != 3:
            raise corrupt(f"the statistic of {key} must be [min, median, max]")
        lo, mid, hi = (optional_count(v, key) for v in value)
        if lo is None or mid is None or hi is None or not lo <= mid <= hi:
            raise corrupt(f"the statistic of {key} must be ordered [min, median, max]")
        out.append((key, Stat(lo, mid, hi)))
    return tuple(out)


def series_from(series: tuple[tuple[str, "Stat | None"], ...], parts: "Sequence[Breakdown]"
                ) -> "tuple[tuple[str, Stat | None], ...] | None":
    """Each measured series of ``series`` (one moment of a :class:`PhaseStats`) made again from every step's
    breakdown at that moment, ``parts``: smallest, median (the lower, as the collector keeps it) and largest; a
    series not measured stays so. None where a breakdown does not hold a figure its series counts: the statistics
    and the records then disagree on what was measured."""
    out: "list[tuple[str, Stat | None]]" = []
    for key, stat in series:
        if stat is None:
            out.append((key, stat))
            continue
        i = STAT_KEYS.index(key)
        got = [p.total if key == "total" else p.counts[i] for p in parts]
        values = sorted(v for v in got if v is not None)
        if len(values) != len(got) or not values:
            return None
        out.append((key, Stat(values[0], values[(len(values) + 1) // 2 - 1], values[-1])))
    return tuple(out)
