"""Views of a Trace: breakdowns, tables (pandas) and a text report.

A :class:`Report` only reads its :class:`~memprof.trace.Trace`; it never
reaches back into hooks, so a report loaded from JSON behaves exactly like
the one that measured it.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from .categories import Category, Phase, TENSOR_CATEGORIES
from .errors import InvalidArgumentError, NotMeasuredError
from .trace import Breakdown, Trace
from .units import format_bytes, printable

if TYPE_CHECKING:
    import pandas as pd

    from .reconciliation import Reconciliation

__all__ = ["Report", "load"]

_WHEN = ("peak", "start", "end")


class Report:
    """Everything a user reads about one profiling session.

    Every figure is an ``int`` of bytes or ``None`` where the run could not
    measure it; text output says "not measured" for ``None``.
    """

    def __init__(self, trace: Trace) -> None:
        if not isinstance(trace, Trace):
            raise InvalidArgumentError(
                f"Report needs a memprof.Trace, got {type(trace).__name__}; get a report from prof.report() "
                "after a 'with memprof.profile(...)' block, or memprof.load(path) for a saved one"
            )
        self.trace = trace

    # -- breakdowns -------------------------------------------------------------

    @property
    def peak(self) -> Breakdown:
        """Composition at the highest total of the whole session."""
        return self.trace.peak

    @property
    def end(self) -> Breakdown:
        """Composition when profiling ended."""
        return self.trace.end

    @property
    def start(self) -> Breakdown:
        """Composition when profiling began (model states that already existed)."""
        return self.trace.start

    @property
    def steps(self) -> int:
        """Number of steps recorded."""
        return len(self.trace.steps)

    def at(self, step: int, phase: "Phase | str", when: str = "peak", *, occurrence: "int | None" = None) -> Breakdown:
        """Composition at the ``"peak"``, ``"start"`` or ``"end"`` of a phase of a step.

        Steps count from 0 (negative indices count from the last step). With
        gradient accumulation a step holds several phases of one kind:
        ``occurrence`` picks one (from 0); by default ``"peak"`` is the highest
        of them, ``"start"`` the first one's start and ``"end"`` the last one's end.
        """
        phase = Phase.parse(phase)
        if when not in _WHEN:
            raise InvalidArgumentError(f"when must be one of {', '.join(_WHEN)}, got {when!r}")
        steps = self.trace.steps
        if not steps:
            raise NotMeasuredError("no step was recorded; run a forward/backward inside the profile")
        if not isinstance(step, int) or isinstance(step, bool):
            raise InvalidArgumentError(f"step must be an int, got {type(step).__name__}")
        if not -len(steps) <= step < len(steps):
            raise InvalidArgumentError(f"step {step} is out of range: this run recorded {len(steps)} step(s)")
        record = steps[step]
        matches = [p for p in record.phases if p.phase is phase]
        if occurrence is not None:
            matches = [p for p in matches if p.occurrence == occurrence]
        if not matches:
            present = ", ".join(f"{p.phase.value}#{p.occurrence}" for p in record.phases) or "none"
            raise NotMeasuredError(f"step {record.index} has no {phase.value} phase (phases: {present})")
        if when == "start":
            return matches[0].start
        if when == "end":
            return matches[-1].end
        return max(matches, key=lambda p: -1 if p.peak.total is None else p.peak.total).peak

    # -- tables -----------------------------------------------------------------

    def phases(self) -> "pd.DataFrame":
        """One row per (step, phase, occurrence): start, peak, end and the composition at the peak.

        Columns: ``step``, ``phase``, ``occurrence``, ``start``, ``peak``,
        ``end``, ``ops`` and one column per category (bytes at the phase's
        peak). Unmeasured figures are missing values (``<NA>``), not 0.
        """
        import pandas as pd

        rows = []
        for rec in self.trace.phases:
            row: dict[str, Any] = {
                "step": rec.step,
                "phase": rec.phase.value,
                "occurrence": rec.occurrence,
                "start": rec.start.total,
                "peak": rec.peak.total,
                "end": rec.end.total,
                "ops": rec.ops,
            }
            for cat in Category:
                row[cat.value] = rec.peak[cat]
            rows.append(row)
        columns = ["step", "phase", "occurrence", "start", "peak", "end", "ops"] + [c.value for c in Category]
        frame = pd.DataFrame(rows, columns=columns)
        for col in columns:
            if col != "phase":
                frame[col] = frame[col].astype("Int64")
        return frame

    def to_frame(self) -> "pd.DataFrame":
        """The flat table to log to any tracker: :meth:`phases` (one row per phase, stable columns)."""
        return self.phases()

    def modules(self) -> "pd.DataFrame":
        """One row per module path: parameters, gradients, saved activations, temporaries peaks.

        ``activations`` include what submodules saved. ``peak_forward`` /
        ``peak_backward``: the most live bytes a call added above its starting
        level; ``temporaries_forward`` / ``temporaries_backward``: the part of
        that released again by the call's end. Indexed by ``path`` (the root
        is ``"<model>"``); ``<NA>`` where not measured.
        """
        import pandas as pd

        cols = ["path", "type", "calls", "parameters", "gradients", "activations",
                "peak_forward", "temporaries_forward", "peak_backward", "temporaries_backward"]
        rows = [{c: getattr(m, c) for c in cols} for m in self.trace.modules]
        frame = pd.DataFrame(rows, columns=cols)
        for col in cols[2:]:
            frame[col] = frame[col].astype("Int64")
        return frame.set_index("path")

    def operations(self, by: str = "op") -> "pd.DataFrame":
        """Operator anatomy (profile with ``operations=True``): Ivanov et al.'s classes with counts,
        flops and bytes read and written, split by phase.

        ``by="op"`` gives one row per (phase, class, op); ``by="class"`` sums
        them per (phase, class). Raises :class:`NotMeasuredError` when the run
        did not record operations.
        """
        import pandas as pd

        ops = self.trace.operations
        if ops is None:
            raise NotMeasuredError(
                "operations were not recorded; profile with memprof.profile(model, optimizer, operations=True)"
            )
        cols = ["phase", "class", "op", "count", "flops", "bytes_read", "bytes_written"]
        frame = pd.DataFrame([(o.phase, o.cls, o.op, o.count, o.flops, o.bytes_read, o.bytes_written)
                              for o in ops], columns=cols)
        if by == "class":
            return frame.groupby(["phase", "class"], as_index=False)[cols[3:]].sum()
        if by != "op":
            raise InvalidArgumentError(f"by must be 'op' or 'class', got {by!r}")
        return frame

    def breakdown_frame(self, which: str = "peak") -> "pd.DataFrame":
        """The breakdown at ``"peak"``, ``"start"`` or ``"end"`` as a table with bytes and shares."""
        import pandas as pd

        bd = {"peak": self.peak, "start": self.start, "end": self.end}.get(which)
        if bd is None:
            raise InvalidArgumentError(f"which must be peak, start or end, got {which!r}")
        rows = []
        for cat in Category:
            v = bd[cat]
            share = (v / bd.total) if (v is not None and bd.total) else None
            rows.append({"category": cat.value, "bytes": v, "share": share})
        frame = pd.DataFrame(rows).set_index("category")
        frame["bytes"] = frame["bytes"].astype("Int64")
        frame["share"] = frame["share"].astype("Float64")
        return frame

    # -- notebooks, plots, comparison ------------------------------------------------

    def _repr_html_(self) -> str:
        from .html import report_html

        return report_html(self)

    def plot(self, ax: Any = None) -> Any:
        """The memory timeline stacked by category, phases shaded, the peak marked (a matplotlib Figure).

        Needs the ``plot`` extra (``pip install 'torch-memprof[plot]'``).
        """
        from .plot import plot_timeline

        return plot_timeline(self, ax=ax)

    def plot_modules(self, top: int = 15, ax: Any = None) -> Any:
        """Saved activations and parameters of the top modules (a matplotlib Figure)."""
        from .plot import plot_modules

        return plot_modules(self, top=top, ax=ax)

    def diff(self, other: Any, **kwargs: Any) -> Any:
        """What grew and shrank from this run to ``other``: see :func:`memprof.diff`."""
        from .compare import diff

        return diff(self, other, **kwargs)

    # -- reconciliation ---------------------------------------------------------

    def reconcile(self, precision: "str | None" = None, optimizer: "str | None" = None, *, at: str = "peak",
                  estimate: Any = None, transformer: Any = None) -> "Reconciliation":
        """Hold this run against the formulas (and a simulation): see :func:`memprof.reconcile`."""
        from .reconciliation import reconcile

        return reconcile(self.trace, precision=precision, optimizer=optimizer, at=at, estimate=estimate,
                         transformer=transformer)

    # -- files ------------------------------------------------------------------

    def save(self, path: "str | os.PathLike[str]") -> None:
        """Write the trace as JSON (with its schema version); :func:`memprof.load` reads it back.

        Written atomically: a failed write leaves an existing file at ``path`` as it was.
        """
        from .files import write_text_atomic

        write_text_atomic(path, json.dumps(self.trace.to_dict(), indent=1) + "\n")

    def to_dict(self) -> dict[str, Any]:
        """The trace as plain JSON-ready data."""
        return self.trace.to_dict()

    # -- text -------------------------------------------------------------------

    def to_text(self, *, top_modules: int = 8) -> str:
        """The readable report that ``print(report)`` shows."""
        t = self.trace
        lines: list[str] = []
        dev = t.device.name if t.device.type == "cuda" else t.device.type
        lines.append(f"memprof report: {len(t.steps)} step(s), mode {t.mode}, device {dev}, torch {t.torch_version}")
        if t.error:
            lines.append(f"profiled code raised {t.error}")
        where = t.peak_location()
        lines.append("")
        lines.append(f"Peak {format_bytes(t.peak.total)}" + (f" ({', '.join(where)})" if where else ""))
        lines.extend(_breakdown_table(t.peak))
        if t.live_at_error is not None:
            lines.append("")
            lines.append(f"Live when the error was raised: {format_bytes(t.live_at_error.total)}")
            lines.extend(_breakdown_table(t.live_at_error))
            if t.live_modules_at_error:
                lines.append("  created by module (activations + temporaries still live):")
                for path, n in t.live_modules_at_error[:8]:
                    lines.append(f"    {path:<38}{format_bytes(n):>12}")
        if t.steps:
            lines.append("")
            lines.append("Phases (bytes at the peak of each phase)")
            header = f"  {'step':>4}  {'phase':<12}{'start':>14}{'peak':>14}{'end':>14}   largest at peak"
            lines.append(header)
            for rec in t.phases:
                label = rec.phase.value + (f" #{rec.occurrence}" if rec.occurrence else "")
                largest = _largest(rec.peak)
                lines.append(
                    f"  {rec.step:>4}  {label:<12}{format_bytes(rec.start.total):>14}"
                    f"{format_bytes(rec.peak.total):>14}{format_bytes(rec.end.total):>14}   {largest}"
                )
        mods = [m for m in t.modules if m.path != "<model>" and (m.activations or m.parameters)]
        if mods and top_modules > 0:
            mods.sort(key=lambda m: (-(m.activations or 0), -(m.parameters or 0)))
            # Show leaves first: a container repeats its children's figures.
            paths = {m.path for m in mods}
            leaves = [m for m in mods if not any(p.startswith(m.path + ".") for p in paths)]
            lines.append("")
            lines.append("Top modules by saved activations")
            lines.append(f"  {'module':<30}{'type':<20}{'params':>11}{'saved act':>13}{'peak fwd':>11}{'peak bwd':>11}")
            for m in leaves[:top_modules]:
                lines.append(
                    f"  {_clip(m.path, 29):<30}{_clip(m.type, 19):<20}{format_bytes(m.parameters):>11}"
                    f"{format_bytes(m.activations):>13}{_fmt_opt(m.peak_forward):>11}"
                    f"{_fmt_opt(m.peak_backward):>11}"
                )
        if t.notes:
            lines.append("")
            lines.append("Notes")
            for note in t.notes:
                lines.append(f"  - {note}")
        return printable("\n".join(lines))

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"<memprof.Report steps={len(self.trace.steps)} peak={format_bytes(self.peak.total)} mode={self.trace.mode}>"


def _fmt_opt(n: "int | None") -> str:
    return "n/m" if n is None else format_bytes(n)


def _clip(s: str, n: int) -> str:
    """``s`` in at most ``n`` characters: a dotted module path keeps its first parts and its last one
    (``encoder.block.3…wo``), which tell blocks apart; anything else keeps its start."""
    if len(s) <= n:
        return s
    parts = s.split(".")
    if len(parts) < 2 or len(parts[-1]) + 2 > n:
        return s[: n - 1] + "…"
    head, tail = "", parts[-1]
    for part in parts[:-1]:
        candidate = f"{head}.{part}" if head else part
        if len(candidate) + 1 + len(tail) > n:
            break
        head = candidate
    for part in reversed(parts[len(head.split(".")) if head else 0:-1]):
        candidate = f"{part}.{tail}"
        if len(head) + 1 + len(candidate) > n:
            break
        tail = candidate
    if not head:
        return (parts[0][: n - len(tail) - 2] + "…" + tail) if n - len(tail) - 2 > 0 else "…" + tail[-(n - 1):]
    return f"{head}…{tail}"


def _largest(bd: Breakdown) -> str:
    measured = [(c, v) for c, v in bd.measured().items() if v]
    if not measured:
        return "-"
    c, v = max(measured, key=lambda cv: cv[1])
    return f"{c.value} {format_bytes(v)}"


def _breakdown_table(bd: Breakdown) -> list[str]:
    lines = []
    for cat in Category:
        v = bd[cat]
        if v is None and cat not in TENSOR_CATEGORIES:
            # Device-only rows on a device that has none: say so once, below.
            continue
        share = f"{100 * v / bd.total:5.1f}%" if (v is not None and bd.total) else "      "
        lines.append(f"  {cat.value:<20}{format_bytes(v):>14}  {share}")
    if all(bd[c] is None for c in (Category.ALLOCATOR_OVERHEAD, Category.OUTSIDE_TORCH)):
        lines.append(f"  {'allocator_overhead':<20}{'not measured':>14}  (no accelerator allocator)")
        lines.append(f"  {'outside_torch':<20}{'not measured':>14}  (no accelerator driver)")
    lines.append(f"  {'total':<20}{format_bytes(bd.total):>14}")
    return lines


def load(path: "str | os.PathLike[str]") -> Report:
    """Read a trace saved by :meth:`Report.save` and return its Report.

    Raises :class:`~memprof.errors.TraceFormatError` for a file that is not
    JSON, not a memprof trace, from a newer schema, or holds impossible values
    (negative or absurdly large byte counts); ``FileNotFoundError`` when there
    is no such file.
    """
    from .files import read_json

    return Report(Trace.from_dict(read_json(path)))
