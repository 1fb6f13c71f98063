"""Per-phase statistics over every step of a run: the part of the record that does not grow.

A long run keeps full detail (a :class:`~memprof.record.trace.StepRecord` with its
breakdowns) for a few steps only; every step, kept or not, adds to one
:class:`PhaseStats` per (phase, occurrence): how many there were, and the
smallest, the median and the largest bytes of each category at the phase's
peak and at its end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

from ..vocabulary import Category, Phase
from .checks import corrupt, count, flag, member, optional_count

__all__ = ["Stat", "PhaseStats", "STAT_KEYS"]

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

    phase: Phase
    occurrence: int
    count: int
    peak: tuple[tuple[str, "Stat | None"], ...]
    end: tuple[tuple[str, "Stat | None"], ...]
    median_exact: bool = True

    def at(self, moment: str, key: "Category | str") -> "Stat | None":
        """The Stat of ``key`` (a category or ``"total"``) at ``"peak"`` or ``"end"``."""
        name = key.value if isinstance(key, Category) else str(key)
        return dict(self.peak if moment == "peak" else self.end).get(name)

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.phase.value, "occurrence": self.occurrence, "count": self.count,
                "peak": {k: list(v) if v is not None else None for k, v in self.peak},
                "end": {k: list(v) if v is not None else None for k, v in self.end},
                "median_exact": self.median_exact}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PhaseStats":
        if not isinstance(data, Mapping):
            raise corrupt("a phase statistic must be a mapping")
        return cls(member(data["phase"], Phase, "a phase statistic's phase"), count(data["occurrence"], "occurrence"),
                   count(data["count"], "a phase count"), _stats(data["peak"]), _stats(data["end"]),
                   flag(data.get("median_exact", True), "median_exact"))


def _stats(data: Any) -> tuple[tuple[str, "Stat | None"], ...]:
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
