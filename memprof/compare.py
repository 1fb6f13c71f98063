"""Compare two runs: what grew, what shrank, by how many bytes.

``diff(a, b)`` reads two Reports (or Traces, or paths of saved traces) and
returns a frozen :class:`Diff`: the breakdown at the global peak category by
category, and the peak total of every phase present in both runs, matched by
``(step, phase, occurrence)``. Deltas are ``b - a`` in bytes; a figure that
either run did not measure gives a delta of ``None``, never 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .categories import Category, Phase
from .errors import InvalidArgumentError
from .trace import Breakdown, Trace
from .units import format_bytes, parse_size, printable

if TYPE_CHECKING:
    import pandas as pd

    from .report import Report

__all__ = ["diff", "Diff", "CategoryDelta", "PhaseDelta"]

_WHEN = ("peak", "start", "end")


def _delta(a: "int | None", b: "int | None") -> tuple["int | None", "float | None"]:
    """``b - a`` and that change in percent of ``a`` (None where undefined)."""
    if a is None or b is None:
        return None, None
    d = b - a
    if a == 0:
        # From nothing: 0 % when nothing changed, otherwise no finite percentage.
        return d, (0.0 if d == 0 else None)
    return d, 100.0 * d / a


def _word(delta: "int | None") -> str:
    if delta is None:
        return ""
    return "grew" if delta > 0 else "shrank" if delta < 0 else "same"


def _signed(n: "int | None") -> str:
    if n is None:
        return "not measured"
    return ("+" if n > 0 else "") + format_bytes(n)


def _pct(p: "float | None", delta: "int | None") -> str:
    if p is None:
        return "new" if delta else ""
    return "0.0%" if p == 0 else f"{p:+.1f}%"


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
    breakdown at ``when`` (the global ``"peak"`` by default); ``total`` is the
    same for the totals. ``phases`` are the phases found in both runs, in
    ``a``'s order; ``only_in_a`` / ``only_in_b`` name the ``(step, phase,
    occurrence)`` keys found in one run only. ``notes`` say where the two runs
    are not measured alike (mode, device), which makes some deltas
    meaningless.
    """

    when: str
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
        import pandas as pd

        frame = pd.DataFrame(
            [{"category": c.name, "a": c.a, "b": c.b, "delta": c.delta, "delta_pct": c.delta_pct}
             for c in self.categories],
            columns=["category", "a", "b", "delta", "delta_pct"],
        ).set_index("category")
        for col in ("a", "b", "delta"):
            frame[col] = frame[col].astype("Int64")
        frame["delta_pct"] = frame["delta_pct"].astype("Float64")
        return frame

    def phases_frame(self) -> "pd.DataFrame":
        """Matched phases as rows: ``step``, ``phase``, ``occurrence``, ``a``, ``b``, ``delta``, ``delta_pct`` (peak totals)."""
        import pandas as pd

        cols = ["step", "phase", "occurrence", "a", "b", "delta", "delta_pct"]
        frame = pd.DataFrame(
            [{"step": p.step, "phase": p.phase.value, "occurrence": p.occurrence, "a": p.a, "b": p.b,
              "delta": p.delta, "delta_pct": p.delta_pct} for p in self.phases],
            columns=cols,
        )
        for col in ("step", "occurrence", "a", "b", "delta"):
            frame[col] = frame[col].astype("Int64")
        frame["delta_pct"] = frame["delta_pct"].astype("Float64")
        return frame

    def to_text(self, *, max_phases: int = 20) -> str:
        la, lb = self.labels
        wa = max(14, len(la) + 2)
        wb = max(14, len(lb) + 2)
        lines = [f"memprof diff: {la} -> {lb} (breakdown at the {self.when})"]
        lines.append(f"  {'category':<20}{la:>{wa}}{lb:>{wb}}{'delta':>14}{'%':>9}")
        for c in (*self.categories, self.total):
            if c.category is None:
                lines.append("  " + "-" * (20 + wa + wb + 14 + 9))
            if c.a is None and c.b is None:
                lines.append(f"  {c.name:<20}{'not measured':>{wa}}{'not measured':>{wb}}")
                continue
            delta = "" if c.delta is None else _signed(c.delta)
            lines.append(
                f"  {c.name:<20}{format_bytes(c.a):>{wa}}{format_bytes(c.b):>{wb}}{delta:>14}"
                f"{_pct(c.delta_pct, c.delta):>9}  {_word(c.delta)}".rstrip()
            )
        if self.phases:
            lines.append("")
            lines.append("Phases (peak total of each phase, matched by step, phase and occurrence)")
            lines.append(f"  {'step':>4}  {'phase':<12}{la:>{wa}}{lb:>{wb}}{'delta':>14}{'%':>9}")
            shown = self.phases if len(self.phases) <= max_phases else self.phases[:max_phases]
            for p in shown:
                label = p.phase.value + (f" #{p.occurrence}" if p.occurrence else "")
                delta = "" if p.delta is None else _signed(p.delta)
                lines.append(
                    f"  {p.step:>4}  {label:<12}{format_bytes(p.a):>{wa}}{format_bytes(p.b):>{wb}}{delta:>14}"
                    f"{_pct(p.delta_pct, p.delta):>9}  {_word(p.delta)}".rstrip()
                )
            if len(self.phases) > len(shown):
                lines.append(f"  … {len(self.phases) - len(shown)} more (diff.phases_frame() has all)")
        for label, keys in ((la, self.only_in_a), (lb, self.only_in_b)):
            if keys:
                names = ", ".join(f"step {s} {ph.value}" + (f" #{o}" if o else "") for s, ph, o in keys[:12])
                more = f" and {len(keys) - 12} more" if len(keys) > 12 else ""
                lines.append(f"Only in {label}: {names}{more}")
        if self.notes:
            lines.append("")
            lines.append("Notes")
            lines.extend(f"  - {n}" for n in self.notes)
        return printable("\n".join(lines))

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        from .html import frame_html

        la, lb = self.labels
        frame = self.to_frame()
        frame.loc["total"] = [self.total.a, self.total.b, self.total.delta, self.total.delta_pct]
        parts = [f"<div><b>memprof diff</b>: {_esc(la)} → {_esc(lb)} (breakdown at the {_esc(self.when)})</div>",
                 frame_html(frame)]
        if self.phases:
            parts.append("<div><b>Phases</b> (peak total of each phase)</div>")
            parts.append(frame_html(self.phases_frame()))
        for label, keys in ((la, self.only_in_a), (lb, self.only_in_b)):
            if keys:
                names = ", ".join(f"step {s} {ph.value}" + (f" #{o}" if o else "") for s, ph, o in keys)
                parts.append(f"<div>Only in {_esc(label)}: {_esc(names)}</div>")
        if self.notes:
            parts.append("<ul>" + "".join(f"<li>{_esc(n)}</li>" for n in self.notes) + "</ul>")
        return "".join(parts)

    def __repr__(self) -> str:
        return (f"<memprof.Diff {self.labels[0]} -> {self.labels[1]} {self.when} total "
                f"{_signed(self.total.delta) if self.total.delta is not None else 'not measured'}>")


def _esc(s: Any) -> str:
    import html

    return html.escape(str(s), quote=True)


def _tolerance(value: "int | float | str") -> float:
    if isinstance(value, str):
        return float(parse_size(value))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise InvalidArgumentError(f"tolerance must be bytes >= 0 (a number or a size like '1 MiB'), got {value!r}")
    return float(value)


def _as_trace(obj: Any, name: str) -> Trace:
    from .report import Report, load

    if isinstance(obj, Report):
        return obj.trace
    if isinstance(obj, Trace):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return load(obj).trace
    raise InvalidArgumentError(
        f"diff() compares memprof Reports, Traces or saved trace files; {name} is a {type(obj).__name__}"
    )


def _pick(trace: Trace, when: str) -> Breakdown:
    return {"peak": trace.peak, "start": trace.start, "end": trace.end}[when]


def diff(a: "Report | Trace | str | os.PathLike[str]", b: "Report | Trace | str | os.PathLike[str]", *,
         when: str = "peak", labels: "tuple[str, str]" = ("a", "b")) -> Diff:
    """Compare run ``b`` against run ``a`` (deltas are ``b - a``).

    ``a`` and ``b`` are Reports, Traces or paths of traces saved with
    ``report.save()``. ``when`` picks the breakdown compared per category:
    the global ``"peak"`` (default), or the ``"start"`` / ``"end"`` of
    profiling. ``labels`` name the runs in the text output.
    """
    if when not in _WHEN:
        raise InvalidArgumentError(f"when must be one of {', '.join(_WHEN)}, got {when!r}")
    if (not isinstance(labels, tuple) or len(labels) != 2 or not all(isinstance(x, str) for x in labels)):
        raise InvalidArgumentError(f"labels must be a tuple of two strings, got {labels!r}")
    ta, tb = _as_trace(a, "a"), _as_trace(b, "b")
    ba, bb = _pick(ta, when), _pick(tb, when)

    cats = tuple(CategoryDelta(c, ba[c], bb[c], *_delta(ba[c], bb[c])) for c in Category)
    total = CategoryDelta(None, ba.total, bb.total, *_delta(ba.total, bb.total))

    def keyed(t: Trace) -> dict[tuple[int, Phase, int], Any]:
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
    return Diff(when, cats, total, phases, only_a, only_b, labels, tuple(notes))
