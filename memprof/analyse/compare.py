"""Compare two runs: what grew, what shrank, by how many bytes.

``diff(a, b)`` reads two Traces (or Reports, or paths of saved traces) and
returns a frozen :class:`Diff`: the breakdown at the global peak category by
category, and the peak total of every phase present in both runs, matched by
``(step, phase, occurrence)``. Deltas are ``b - a`` in bytes; a figure that
either run did not measure gives a delta of ``None``, never 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..vocabulary import PHASE_MOMENTS, Category, Phase, parse_moment
from ..errors import InvalidArgumentError, is_interrupt
from ..record.parts import PhaseRecord
from ..record.trace import Breakdown, Trace, TraceSource, as_trace
from ..record.views import show
from ..units import parse_size

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["diff", "Diff", "CategoryDelta", "PhaseDelta"]


def _delta(a: "int | None", b: "int | None") -> tuple["int | None", "float | None"]:
    """``b - a`` and that change in percent of ``a`` (None where undefined)."""
    if a is None or b is None:
        return None, None
    d = b - a
    if a == 0:
        # From nothing: 0 % when nothing changed, otherwise no finite percentage.
        return d, (0.0 if d == 0 else None)
    return d, 100.0 * d / a


@dataclass(frozen=True)
class CategoryDelta:
    """One category (or the total) at the compared moment of both runs."""

    category: "Category | None"  # None for the total
    a: "int | None"
    b: "int | None"
    delta: "int | None"
    delta_pct: "float | None"

    @property
    def name(self) -> str:
        return "total" if self.category is None else self.category.value


@dataclass(frozen=True)
class PhaseDelta:
    """The peak total of one phase present in both runs."""

    step: int
    phase: Phase
    occurrence: int
    a: "int | None"
    b: "int | None"
    delta: "int | None"
    delta_pct: "float | None"

    @property
    def key(self) -> tuple[int, Phase, int]:
        return (self.step, self.phase, self.occurrence)


@dataclass(frozen=True)
class Diff:
    """What changed from run ``a`` to run ``b``.

    ``categories`` has one entry per :class:`Category` (in enum order) for the
    breakdown at ``at`` (the global ``"peak"`` by default); ``total`` is the
    same for the totals. ``phases`` are the phases found in both runs, in
    ``a``'s order; ``only_in_a`` / ``only_in_b`` name the ``(step, phase,
    occurrence)`` keys found in one run only. ``notes`` say where the two runs
    are not measured alike (mode, device), which makes some deltas
    meaningless. Its text, tables and HTML are views registered by the facade (:mod:`memprof.record.views`).
    """

    at: str
    categories: tuple[CategoryDelta, ...]
    total: CategoryDelta
    phases: tuple[PhaseDelta, ...]
    only_in_a: tuple[tuple[int, Phase, int], ...]
    only_in_b: tuple[tuple[int, Phase, int], ...]
    labels: tuple[str, str] = ("a", "b")
    notes: tuple[str, ...] = ()

    def __getitem__(self, category: "Category | str") -> CategoryDelta:
        """The entry of one category; ``diff["total"]`` gives :attr:`total`."""
        if isinstance(category, str) and category.strip().lower() == "total":
            return self.total
        cat = Category.parse(category)
        return next(c for c in self.categories if c.category is cat)

    def grew(self, tolerance: "int | float | str" = 0.0, *, rel: float = 0.0) -> list[tuple[Category, int]]:
        """Categories whose bytes grew by more than ``tolerance`` bytes and more than ``rel`` × a.

        ``tolerance`` is bytes (an int, a float, or a size string such as
        ``"1 MiB"``); ``rel`` is a fraction of run ``a``'s figure (``0.05`` =
        5 %). Categories not measured in either run are never listed.
        """
        tol = _tolerance(tolerance)
        return [(c.category, c.delta) for c in self.categories
                if c.category is not None and c.delta is not None and c.delta > tol
                and c.delta > rel * (c.a or 0)]

    def shrank(self, tolerance: "int | float | str" = 0.0, *, rel: float = 0.0) -> list[tuple[Category, int]]:
        """Categories whose bytes fell by more than ``tolerance`` bytes and more than ``rel`` × a."""
        tol = _tolerance(tolerance)
        return [(c.category, c.delta) for c in self.categories
                if c.category is not None and c.delta is not None and -c.delta > tol
                and -c.delta > rel * (c.a or 0)]

    @property
    def unchanged(self) -> bool:
        """True when every measured category, the total and every matched phase are equal, and no phase is unmatched."""
        return (all(c.delta in (0, None) for c in (*self.categories, self.total))
                and all(p.delta in (0, None) for p in self.phases)
                and not self.only_in_a and not self.only_in_b)

    def to_frame(self) -> "pd.DataFrame":
        """Categories as rows (index ``category``), columns ``a``, ``b``, ``delta``, ``delta_pct``.

        Bytes are nullable ``Int64`` (``<NA>`` where not measured),
        ``delta_pct`` is ``Float64`` percent of ``a``. The total is not a row
        (summing the column stays honest); it is :attr:`total`.
        """
        return show(self, "to_frame")

    def phases_frame(self) -> "pd.DataFrame":
        """Matched phases as rows: ``step``, ``phase``, ``occurrence``, ``a``, ``b``, ``delta``, ``delta_pct``
        (peak totals)."""
        return show(self, "phases_frame")

    def to_text(self, *, max_phases: int = 20) -> str:
        """What ``print(diff)`` shows: the categories, then at most ``max_phases`` matched phases."""
        text: str = show(self, "to_text", max_phases=max_phases)
        return text

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        html: str = show(self, "_repr_html_")
        return html

    def __repr__(self) -> str:
        text: str = show(self, "__repr__")
        return text


def _tolerance(value: "int | float | str") -> float:
    if isinstance(value, str):
        return float(parse_size(value))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise InvalidArgumentError(f"tolerance must be bytes >= 0 (a number or a size like '1 MiB'), got {value!r}")
    return float(value)


def _as_trace(obj: object, name: str) -> Trace:
    if isinstance(obj, (str, os.PathLike)):
        from ..record.files import load_trace

        return load_trace(obj)
    try:
        return as_trace(obj)
    except InvalidArgumentError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise InvalidArgumentError(
            f"diff() compares memprof Reports, Traces or saved trace files; {name} is a {type(obj).__name__}"
        ) from None


def _pick(trace: Trace, at: str) -> Breakdown:
    return {"peak": trace.peak, "start": trace.start, "end": trace.end}[at]


def diff(a: TraceSource, b: TraceSource, *,
         at: str = "peak", labels: "tuple[str, str]" = ("a", "b")) -> Diff:
    """Compare run ``b`` against run ``a`` (deltas are ``b - a``).

    ``a`` and ``b`` are Traces, anything holding one as ``.trace`` (a Report) or paths of traces saved
    with ``report.save()``. ``at`` picks the breakdown compared per category:
    the global ``"peak"`` (default), or the ``"start"`` / ``"end"`` of
    profiling. ``labels`` name the runs in the text output.
    """
    at = parse_moment(at, PHASE_MOMENTS)
    if (not isinstance(labels, tuple) or len(labels) != 2 or not all(isinstance(x, str) for x in labels)):
        raise InvalidArgumentError(f"labels must be a tuple of two strings, got {labels!r}")
    ta, tb = _as_trace(a, "a"), _as_trace(b, "b")
    ba, bb = _pick(ta, at), _pick(tb, at)

    cats = tuple(CategoryDelta(c, ba[c], bb[c], *_delta(ba[c], bb[c])) for c in Category)
    total = CategoryDelta(None, ba.total, bb.total, *_delta(ba.total, bb.total))

    def keyed(t: Trace) -> dict[tuple[int, Phase, int], PhaseRecord]:
        return {(p.step, p.phase, p.occurrence): p for p in t.phases}

    pa, pb = keyed(ta), keyed(tb)
    phases = tuple(
        PhaseDelta(k[0], k[1], k[2], pa[k].peak.total, pb[k].peak.total, *_delta(pa[k].peak.total, pb[k].peak.total))
        for k in pa if k in pb
    )
    only_a = tuple(k for k in pa if k not in pb)
    only_b = tuple(k for k in pb if k not in pa)

    notes = []
    if ta.mode != tb.mode:
        notes.append(f"{labels[0]} was measured in {ta.mode} mode and {labels[1]} in {tb.mode} mode; "
                     "categories such as temporaries are measured differently")
    if (ta.device.type, ta.device.name) != (tb.device.type, tb.device.name):
        notes.append(f"{labels[0]} ran on {ta.device.type} ({ta.device.name}) and {labels[1]} on "
                     f"{tb.device.type} ({tb.device.name}); allocator figures are not comparable")
    if ta.torch_version != tb.torch_version:
        notes.append(f"torch versions differ ({ta.torch_version} vs {tb.torch_version}); "
                     "saved tensors and temporaries can change between versions")
    for t, label in ((ta, labels[0]), (tb, labels[1])):
        if t.error:
            notes.append(f"{label} ended with an error ({t.error}); its figures are partial")
    return Diff(at, cats, total, phases, only_a, only_b, labels, tuple(notes))
