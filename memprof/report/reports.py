"""The Report: the one object a user reads, a thin facade over a Trace and its renderers.

A :class:`Report` only reads its :class:`~memprof.record.trace.Trace`; it never
reaches back into hooks, so a report loaded from JSON behaves exactly like
the one that measured it. Its text, tables, HTML and figures are
:mod:`memprof.render`'s; its breakdowns, diff and reconciliation are :mod:`memprof.analyse`'s.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..analyse.generation import generation_summary
from ..errors import InvalidArgumentError
from ..record.aliases import Drawing, JSONObject, UserObject
from ..record.trace import Breakdown, Trace, TraceSource
from ..units import format_bytes
from ..vocabulary import Phase
from .comparison import Diff, diff
from .wrap import Forwarded

if TYPE_CHECKING:
    from typing import Mapping

    from ..record.device_memory import DeviceMemory
    from ..record.estimate import Estimate, WhatIf
    from ..simulate.device_memory import AllocationStream
    import pandas as pd

    from .reconciliation import Reconciliation

__all__ = ["Report", "load", "levers", "oom_levers", "page_reconciliation"]


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
        #: The run's allocation stream when it was profiled with ``record_allocations=True`` (not saved).
        self.allocations: "AllocationStream | None" = None

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

    def breakdown(self, step: int, phase: "Phase | str", at: str = "peak", *,
                  occurrence: "int | None" = None) -> Breakdown:
        """Composition at the ``"peak"``, ``"start"`` or ``"end"`` of a phase of a step.

        Steps count from 0 (negative indices count from the last step). With
        gradient accumulation a step holds several phases of one kind:
        ``occurrence`` picks one (from 0); by default ``"peak"`` is the highest
        of them, ``"start"`` the first one's start and ``"end"`` the last one's end.
        """
        from ..analyse.breakdowns import phase_breakdown

        return phase_breakdown(self.trace, step, phase, at, occurrence=occurrence)

    # -- tables (memprof.render.frames) -------------------------------------------------

    def phases(self) -> "pd.DataFrame":
        """One row per (step, phase, occurrence): start, peak, end and the composition at the peak.

        Columns: ``step``, ``phase``, ``occurrence``, ``start``, ``peak``,
        ``end``, ``ops`` and one column per category (bytes at the phase's
        peak). Unmeasured figures are missing values (``<NA>``), not 0.
        """
        from ..render.frames import phases_frame

        return phases_frame(self.trace)

    def phase_stats(self) -> "pd.DataFrame":
        """Every step of the run summarised, kept in full or not: one row per (phase, occurrence,
        moment, category) with ``count``, ``min``, ``median`` and ``max`` bytes at the phase's
        ``"peak"`` and ``"end"``. ``median_exact`` is False where the values were too varied to keep
        them all (the median of an evenly thinned sample). ``<NA>`` where not measured."""
        from ..render.frames import phase_stats_frame

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
        from ..render.frames import modules_frame

        return modules_frame(self.trace)

    def operations(self, by: str = "op") -> "pd.DataFrame":
        """Operator anatomy (profile with ``operations=True``): Ivanov et al.'s classes with counts,
        flops and bytes read and written, split by phase.

        ``by="op"`` gives one row per (phase, class, op); ``by="class"`` sums
        them per (phase, class). Raises :class:`~memprof.errors.NotMeasuredError` when the run
        did not record operations.
        """
        from ..render.frames import operations_frame

        return operations_frame(self.trace, by)

    def breakdown_frame(self, at: str = "peak") -> "pd.DataFrame":
        """The breakdown at ``"peak"`` (default), ``"start"`` or ``"end"`` as a table with bytes and shares."""
        from ..render.frames import breakdown_frame

        return breakdown_frame(self.trace, at)

    # -- notebooks, plots, comparison ------------------------------------------------

    def _repr_html_(self) -> str:
        from ..render.html import report_html

        return report_html(self.trace, levers=oom_levers(self.trace), generation=generation_summary(self.trace))

    def plot(self, ax: "Drawing | None" = None) -> Drawing:
        """The memory timeline stacked by category, phases shaded, the peak marked (a matplotlib Figure).

        Needs the ``plot`` extra (``pip install 'torch-memprof[plot]'``).
        """
        from ..render.plot import plot_timeline

        return plot_timeline(self.trace, ax=ax)

    def plot_modules(self, top: int = 15, ax: "Drawing | None" = None) -> Drawing:
        """Saved activations and parameters of the top modules (a matplotlib Figure)."""
        from ..render.plot import plot_modules

        return plot_modules(self.trace, top=top, ax=ax)

    def diff(self, other: TraceSource, *, at: str = "peak", labels: "tuple[str, str]" = ("a", "b")) -> Diff:
        """What grew and shrank from this run to ``other``: see :func:`memprof.diff`."""
        return diff(self, other, at=at, labels=labels)

    def what_a_gpu_would_reserve(self, gpu: Forwarded = None, *, alloc_conf: Forwarded = None) -> "DeviceMemory":
        """What ``gpu`` (a name such as ``"a100-80gb"`` or a GpuSpec) would reserve for this run's allocation
        stream: the caching-allocator model's reserved bytes and the memory outside torch, the fit and the
        headroom (a :class:`~memprof.record.device_memory.DeviceMemory`; ``print()`` it). On a CUDA run it
        also puts the model's reserved beside the measured one and splits NVML's outside-torch figure. Needs
        ``memprof.profile(..., record_allocations=True)``."""
        from ..simulate.device_memory import what_a_gpu_would_reserve

        return what_a_gpu_would_reserve(self.trace, self.allocations, gpu=gpu, alloc_conf=alloc_conf)

    def what_if(self, model: Forwarded, optimizer: Forwarded = None, **change: Forwarded) -> "WhatIf":
        """This run with something changed (``checkpointing=True``, ``precision=``, ``parallel=``,
        ``world_size=``, ``batch_size=``), simulated: an Estimate of the changed run whose ``saving`` is, per
        category, this run's bytes at its peak less the changed run's. The trace does not hold the model's
        code, which decides what autograd saves: pass the run's ``model`` and ``optimizer`` and its ``inputs=``
        (``targets=``, ``loss_fn=``) again. See :func:`memprof.simulate.whatif.what_if`."""
        from .whatif import what_if

        return what_if(self.trace, model, optimizer, **change)

    def reconcile(self, precision: "str | None" = None, optimizer: "str | None" = None, *, at: object = "peak",
                  estimate: "Estimate | None" = None, transformer: "Mapping[str, UserObject] | None" = None
                  ) -> "Reconciliation":
        """Hold this run against the formulas (and an estimate): see :func:`memprof.reconcile`."""
        from .reconciliation import reconcile

        return reconcile(self.trace, precision=precision, optimizer=optimizer, at=at, estimate=estimate,
                         transformer=transformer)

    # -- files and text ------------------------------------------------------------------

    def save(self, path: "str | os.PathLike[str]") -> None:
        """Write the trace as JSON (with its schema version); :func:`memprof.load` reads it back.

        Written atomically: a failed write leaves an existing file at ``path`` as it was, and compact: an indented
        file is written by json's Python encoder, which took 5.9 s for a trace of 20,000 steps where the C encoder
        takes about one (``python -m json.tool`` indents a copy to read).
        """
        from ..record.files import write_json_atomic

        write_json_atomic(path, self.trace.to_dict())

    def export_chrome_trace(self, path: "str | os.PathLike[str]") -> None:
        """Write a Chrome trace (JSON) to open in ui.perfetto.dev or chrome://tracing: a counter track per
        category, spans for steps, phases and modules, each phase's peak with its composition."""
        from ..render.export import export_chrome_trace

        export_chrome_trace(self.trace, path)

    def export_memory_viz(self, path: "str | os.PathLike[str]") -> None:
        """Write a pickled snapshot in ``torch.cuda.memory._snapshot()``'s format for pytorch.org/memory_viz;
        each block's frames name its category, module and phase."""
        from ..render.export import export_memory_viz

        export_memory_viz(self.trace, path)

    def export_html(self, path: "str | os.PathLike[str]") -> None:
        """Write :meth:`to_html` to ``path``, atomically."""
        from ..render.export import export_html

        export_html(self.trace, path, page_reconciliation(self.trace), oom_levers(self.trace),
                    generation_summary(self.trace))

    def attribute_snapshot(self, snapshot: UserObject) -> "pd.DataFrame":
        """A real CUDA memory snapshot's active blocks with memprof's category and module, one row each
        (address, size, requested_size, category, module, device). ``snapshot``: the dict of
        ``torch.cuda.memory._snapshot()`` or its pickle's path, taken while this run's storages were
        live, as the one written beside an OOM dump; see :func:`memprof.render.memory_viz.attribute_snapshot`."""
        from ..render.frames import snapshot_frame

        return snapshot_frame(self.trace, snapshot)

    def to_html(self) -> str:
        """The report as one self-contained HTML page, readable offline (no script, no network):
        what :meth:`export_html` writes."""
        from ..render.export import html_page

        return html_page(self.trace, page_reconciliation(self.trace), oom_levers(self.trace),
                         generation_summary(self.trace))

    def to_dict(self) -> JSONObject:
        """The trace as plain JSON-ready data."""
        return self.trace.to_dict()

    def to_text(self, *, top_modules: int = 8) -> str:
        """The readable report that ``print(report)`` shows."""
        from ..render.text import report_text

        return report_text(self.trace, top_modules=top_modules, levers=oom_levers(self.trace),
                           generation=generation_summary(self.trace))

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return (f"<memprof.Report num_steps={self.num_steps} peak={format_bytes(self.peak.total)} "
                f"mode={self.trace.mode}>")


def load(path: "str | os.PathLike[str]") -> Report:
    """Read a trace saved by :meth:`Report.save` and return its Report.

    Raises :class:`~memprof.errors.TraceFormatError` for a file that is not
    JSON, not a memprof trace, from a newer schema, or holds impossible values
    (negative or absurdly large byte counts); ``FileNotFoundError`` when there
    is no such file.
    """
    from ..record.files import load_trace

    return Report(load_trace(path))


def levers(trace: Trace) -> list[str]:
    """The largest levers of a run that ended in an out-of-memory error (what its report lists under what was
    live): the advice for what was live then, or at the peak; none where the advice cannot be given."""
    from ..analyse.reconciler.advice import advice
    from ..anatomy.params import infer_precision
    from ..errors import MemprofError, is_interrupt

    measured = trace.live_at_error if trace.live_at_error is not None else trace.peak
    try:
        return advice(trace, measured, infer_precision(trace), trace.optimizer)
    except MemprofError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return []


def oom_levers(trace: Trace) -> list[str]:
    """What a report's views list under what was live at an out-of-memory error: :func:`levers` of a run that
    ended in one, none for another (whose views have no such section)."""
    return levers(trace) if trace.oom is not None else []


def page_reconciliation(trace: Trace) -> "Reconciliation | str":
    """The reconciliation the HTML page shows (:func:`memprof.render.page.report_page`): the run's
    :class:`~memprof.analyse.reconciler.Reconciliation`, or why the formulas give none (a str)."""
    from ..analyse.reconciler import reconcile
    from ..errors import MemprofError, is_interrupt

    try:
        return reconcile(trace)
    except MemprofError as exc:  # e.g. a run whose precision or optimizer the formulas do not know
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return str(exc)
