"""The Report: the one object a user reads, a thin facade over a Trace and its renderers.

A :class:`Report` only reads its :class:`~memprof.record.trace.Trace`; it never
reaches back into hooks, so a report loaded from JSON behaves exactly like
the one that measured it. Its text, tables, HTML and figures are
:mod:`memprof.render`'s; its reconciliation is :mod:`memprof.analyse.reconciler`'s.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .vocabulary import PHASE_MOMENTS, Phase, parse_moment
from .errors import InvalidArgumentError, NotMeasuredError, renamed_argument, warn_renamed
from .record.trace import Breakdown, Trace
from .units import format_bytes

if TYPE_CHECKING:
    import pandas as pd

    from .analyse.compare import Diff
    from .analyse.reconciler import Reconciliation

__all__ = ["Report", "load"]


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
    def rank(self) -> "int | None":
        """This process's rank in the torch.distributed job it ran in; None outside a process group."""
        return self.trace.distributed.rank if self.trace.distributed is not None else None

    @property
    def world_size(self) -> "int | None":
        """The number of ranks of that job; None outside a process group."""
        return self.trace.distributed.world_size if self.trace.distributed is not None else None

    @property
    def num_steps(self) -> int:
        """Number of steps the run had. ``report.trace.steps`` holds those kept in full (in a long run,
        the first ones, the peak's, the last and those a schedule selected); :meth:`phase_stats`
        summarises all of them."""
        return self.trace.num_steps

    @property
    def steps(self) -> int:
        """Deprecated: the number of steps, now :attr:`num_steps` (``trace.steps`` holds the records)."""
        warn_renamed("Report.steps", "Report.num_steps")
        return self.num_steps

    def at(self, step: int, phase: "Phase | str", at: "str | None" = None, *, occurrence: "int | None" = None,
           when: "str | None" = None) -> Breakdown:
        """Composition at the ``"peak"``, ``"start"`` or ``"end"`` of a phase of a step.

        Steps count from 0 (negative indices count from the last step). With
        gradient accumulation a step holds several phases of one kind:
        ``occurrence`` picks one (from 0); by default ``"peak"`` is the highest
        of them, ``"start"`` the first one's start and ``"end"`` the last one's end.
        (``when=`` is the deprecated name of ``at=``.)
        """
        at = renamed_argument("at", at, "when", when, "Report.at")
        phase = Phase.parse(phase)
        at = parse_moment("peak" if at is None else at, PHASE_MOMENTS)
        steps = self.trace.steps
        if not steps:
            raise NotMeasuredError("no step was recorded; run a forward/backward inside the profile")
        if not isinstance(step, int) or isinstance(step, bool):
            raise InvalidArgumentError(f"step must be an int, got {type(step).__name__}")
        total = self.num_steps
        if not -total <= step < total:
            raise InvalidArgumentError(f"step {step} is out of range: this run had {total} step(s)")
        index = step + total if step < 0 else step
        record = next((s for s in steps if s.index == index), None)
        if record is None:
            kept = ", ".join(str(s.index) for s in steps[:8]) + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")
            every = "every recorded step" if self.trace.schedule is not None else "every step"
            raise NotMeasuredError(
                f"step {index} is not kept in full (kept: {kept}); report.phase_stats() summarises {every}, "
                "and memprof.schedule() selects steps to keep")
        matches = [p for p in record.phases if p.phase is phase]
        if occurrence is not None and (isinstance(occurrence, bool) or not isinstance(occurrence, int)):
            raise InvalidArgumentError(f"occurrence must be an int (0 for the first {phase.value} of the step), "
                                       f"got {occurrence!r}")
        if occurrence is not None:
            matches = [p for p in matches if p.occurrence == occurrence]
        if not matches:
            present = ", ".join(f"{p.phase.value}#{p.occurrence}" for p in record.phases) or "none"
            raise NotMeasuredError(f"step {record.index} has no {phase.value} phase (phases: {present})")
        if at == "start":
            return matches[0].start
        if at == "end":
            return matches[-1].end
        return max(matches, key=lambda p: -1 if p.peak.total is None else p.peak.total).peak

    # -- tables (memprof.render.frames) -------------------------------------------------

    def phases(self) -> "pd.DataFrame":
        """One row per (step, phase, occurrence): start, peak, end and the composition at the peak.

        Columns: ``step``, ``phase``, ``occurrence``, ``start``, ``peak``,
        ``end``, ``ops`` and one column per category (bytes at the phase's
        peak). Unmeasured figures are missing values (``<NA>``), not 0.
        """
        from .render.frames import phases_frame

        return phases_frame(self.trace)

    def phase_stats(self) -> "pd.DataFrame":
        """Every step of the run summarised, kept in full or not: one row per (phase, occurrence,
        moment, category) with ``count``, ``min``, ``median`` and ``max`` bytes at the phase's
        ``"peak"`` and ``"end"``. ``median_exact`` is False where the values were too varied to keep
        them all (the median of an evenly thinned sample). ``<NA>`` where not measured."""
        from .render.frames import phase_stats_frame

        return phase_stats_frame(self.trace)

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
        from .render.frames import modules_frame

        return modules_frame(self.trace)

    def operations(self, by: str = "op") -> "pd.DataFrame":
        """Operator anatomy (profile with ``operations=True``): Ivanov et al.'s classes with counts,
        flops and bytes read and written, split by phase.

        ``by="op"`` gives one row per (phase, class, op); ``by="class"`` sums
        them per (phase, class). Raises :class:`NotMeasuredError` when the run
        did not record operations.
        """
        from .render.frames import operations_frame

        return operations_frame(self.trace, by)

    def breakdown_frame(self, at: "str | None" = None, *, which: "str | None" = None) -> "pd.DataFrame":
        """The breakdown at ``"peak"`` (default), ``"start"`` or ``"end"`` as a table with bytes and shares
        (``which=`` is the deprecated name of ``at=``)."""
        from .render.frames import breakdown_frame

        at = renamed_argument("at", at, "which", which, "Report.breakdown_frame")
        return breakdown_frame(self.trace, "peak" if at is None else at)

    # -- notebooks, plots, comparison ------------------------------------------------

    def _repr_html_(self) -> str:
        from .render.html import report_html

        return report_html(self.trace)

    def plot(self, ax: Any = None) -> Any:
        """The memory timeline stacked by category, phases shaded, the peak marked (a matplotlib Figure).

        Needs the ``plot`` extra (``pip install 'torch-memprof[plot]'``).
        """
        from .render.plot import plot_timeline

        return plot_timeline(self.trace, ax=ax)

    def plot_modules(self, top: int = 15, ax: Any = None) -> Any:
        """Saved activations and parameters of the top modules (a matplotlib Figure)."""
        from .render.plot import plot_modules

        return plot_modules(self.trace, top=top, ax=ax)

    def diff(self, other: Any, *, at: "str | None" = None, labels: "tuple[str, str]" = ("a", "b"),
             when: "str | None" = None) -> "Diff":
        """What grew and shrank from this run to ``other``: see :func:`memprof.diff`."""
        from .analyse.compare import diff

        at = renamed_argument("at", at, "when", when, "Report.diff")
        return diff(self, other, at="peak" if at is None else at, labels=labels)

    def reconcile(self, precision: "str | None" = None, optimizer: "str | None" = None, *, at: Any = "peak",
                  estimate: Any = None, transformer: Any = None) -> "Reconciliation":
        """Hold this run against the formulas (and a simulation): see :func:`memprof.reconcile`."""
        from .analyse.reconciler import reconcile

        return reconcile(self.trace, precision=precision, optimizer=optimizer, at=at, estimate=estimate,
                         transformer=transformer)

    # -- files and text ------------------------------------------------------------------

    def save(self, path: "str | os.PathLike[str]") -> None:
        """Write the trace as JSON (with its schema version); :func:`memprof.load` reads it back.

        Written atomically: a failed write leaves an existing file at ``path`` as it was.
        """
        from .record.files import write_json_atomic

        write_json_atomic(path, self.trace.to_dict(), indent=1)

    def export_chrome_trace(self, path: "str | os.PathLike[str]") -> None:
        """Write a Chrome trace (JSON) to open in ui.perfetto.dev or chrome://tracing: a counter track per
        category, spans for steps, phases and modules, each phase's peak with its composition."""
        from .render.export import export_chrome_trace

        export_chrome_trace(self.trace, path)

    def export_memory_viz(self, path: "str | os.PathLike[str]") -> None:
        """Write a pickled snapshot in ``torch.cuda.memory._snapshot()``'s format for pytorch.org/memory_viz;
        each block's frames name its category, module and phase."""
        from .render.export import export_memory_viz

        export_memory_viz(self.trace, path)

    def attribute_snapshot(self, snapshot: Any) -> "pd.DataFrame":
        """A real CUDA memory snapshot's active blocks with memprof's category and module, one row each
        (address, size, requested_size, category, module, device). ``snapshot``: the dict of
        ``torch.cuda.memory._snapshot()`` or its pickle's path, taken while this run's storages were
        live, as the one written beside an OOM dump; see :func:`memprof.render.memory_viz.attribute_snapshot`."""
        import pickle

        import pandas as pd

        from .render.memory_viz import attribute_snapshot

        if isinstance(snapshot, (str, os.PathLike)):
            try:
                with open(snapshot, "rb") as fh:
                    snapshot = pickle.load(fh)
            except FileNotFoundError:
                raise InvalidArgumentError(f"no snapshot at {os.fspath(snapshot)}") from None
            except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as exc:
                raise InvalidArgumentError(
                    f"{os.fspath(snapshot)} is not a pickled memory snapshot ({type(exc).__name__}); give the file "
                    "torch.cuda.memory._snapshot() was pickled to (memprof writes one beside an OOM dump)") from None
        columns = ["address", "size", "requested_size", "category", "module", "device"]
        return pd.DataFrame(attribute_snapshot(self.trace, snapshot), columns=columns)

    def to_html(self, path: "str | os.PathLike[str]") -> None:
        """Write the report as one self-contained HTML file, readable offline (no script, no network)."""
        from .render.export import write_html

        write_html(self.trace, path)

    def to_dict(self) -> dict[str, Any]:
        """The trace as plain JSON-ready data."""
        return self.trace.to_dict()

    def to_text(self, *, top_modules: int = 8) -> str:
        """The readable report that ``print(report)`` shows."""
        from .render.text import report_text

        return report_text(self.trace, top_modules=top_modules)

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return (f"<memprof.Report steps={self.num_steps} peak={format_bytes(self.peak.total)} "
                f"mode={self.trace.mode}>")


def load(path: "str | os.PathLike[str]") -> Report:
    """Read a trace saved by :meth:`Report.save` and return its Report.

    Raises :class:`~memprof.errors.TraceFormatError` for a file that is not
    JSON, not a memprof trace, from a newer schema, or holds impossible values
    (negative or absurdly large byte counts); ``FileNotFoundError`` when there
    is no such file.
    """
    from .record.files import load_trace

    return Report(load_trace(path))
