"""Figures for people: the memory timeline, the module table, a waterfall.

matplotlib is optional (``pip install 'torch-memprof[plot]'``) and is imported
inside each function, never at import time; without it the functions raise
:class:`MissingExtraError`. Every function returns the
:class:`matplotlib.figure.Figure` it drew on (the ``SubFigure``, for an ``ax`` drawn
in one) and never calls ``plt.show()`` or changes matplotlib's global settings.

The colors of categories and phases are :mod:`.common`'s, so that a category
has the same color in every figure and in the HTML report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..vocabulary import Category, Phase
from ..errors import InvalidArgumentError, MissingExtraError, NotMeasuredError, is_interrupt
from ..record.aliases import Drawing
from ..record.trace import as_trace
from ..units import format_bytes, one_line
from .common import CATEGORY_COLORS, PHASE_COLORS, WATERFALL_COLORS, clip_path, own_rows, OwnFigure, quiet

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure, SubFigure

    from ..analyse.reconciler import Reconciliation
    from ..record.trace import Sample, Trace

__all__ = [
    "plot_timeline",
    "plot_modules",
    "plot_waterfall",
    "plot_reconciliation",
]


_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def _pyplot() -> Drawing:
    """matplotlib's figure machinery, or a MissingExtraError naming the extra."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure
    except ImportError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise MissingExtraError(
            "memprof's plots need matplotlib, which is not installed; "
            "install it with: pip install 'torch-memprof[plot]'"
        ) from None
    return Figure


def _new_axes(ax: "Axes | None", size: tuple[float, float]) -> "tuple[Figure | SubFigure, Axes]":
    """The figure to draw on and its axes: ``ax``'s own (a subfigure's, where the user drew ``ax`` in one), or
    a new figure's."""
    Figure = _pyplot()
    if ax is not None:
        return ax.figure, ax
    # A bare Figure (not pyplot) so nothing is registered globally and no
    # display backend is needed; Jupyter still renders a returned Figure.
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.add_subplot()


def _unit(largest: "int | float") -> tuple[str, int]:
    """The IEC unit that shows ``largest`` as a number between 1 and 1024."""
    for name, size in _UNITS:
        if largest >= size:
            return name, size
    return "B", 1


def _where(trace: "Trace") -> str:
    parts = []
    if trace.peak_step is not None:
        parts.append(f"step {trace.peak_step}")
    label = trace.peak_phase_label()
    if label is not None:
        parts.append(label)
    return ", ".join(parts)


def plot_timeline(trace: "Trace", ax: "Axes | None" = None) -> "Figure | SubFigure":
    """The memory timeline, stacked by category, with phases shaded and the peak marked.

    One x position per timeline sample (samples are taken at module and phase
    boundaries, so x counts profiling events, not seconds). Categories this
    run did not measure are left out of the stack and named in the title; a
    category measured as 0 stays in the legend. The dashed line is the
    session's peak total, which can lie above every sample because the peak
    may fall between two boundaries.
    """
    trace = as_trace(trace)
    samples = trace.timeline
    if not samples:
        raise NotMeasuredError(
            "this trace has no timeline samples; profile with memprof.profile(..., timeline=True) "
            "(the default) and run at least one forward"
        )
    fig, ax = _new_axes(ax, (11, 5))

    measured = [c for c in Category if any(s.breakdown[c] is not None for s in samples)
                and not quiet(c, *(s.breakdown[c] for s in samples))]
    missing = [c for c in Category if c not in measured and not quiet(c, *(s.breakdown[c] for s in samples))]
    partly = [c for c in measured if any(s.breakdown[c] is None for s in samples)]

    totals = [sum(v for v in s.breakdown.measured().values()) for s in samples]
    peak_total = trace.peak.total
    top = max([*totals, peak_total or 0, 1])
    unit, scale = _unit(top)

    xs = list(range(len(samples)))
    # A category measured at some samples but not others (rare: a degraded
    # measurement) is drawn as 0 where missing, and said so in the title.
    ys = [[(s.breakdown[c] or 0) / scale for s in samples] for c in measured]
    labels = [f"{c.value} ({format_bytes(trace.peak[c])} at peak)" if trace.peak[c] is not None else c.value
              for c in measured]
    stacks = ax.stackplot(xs, ys, labels=labels, colors=[CATEGORY_COLORS[c] for c in measured],
                          linewidth=0.0, zorder=2) if measured else []
    for coll, cat in zip(stacks, measured):
        coll.set_gid(f"memprof-stack-{cat.value}")

    seen_phases = _phase_bands(ax, samples)
    _step_marks(ax, samples)
    _peak_line(ax, trace, top, scale)
    ax.set_xlim(-0.5, len(samples) - 0.5)
    _timeline_labels(ax, trace, unit, missing, partly, seen_phases)
    return fig


def _phase_bands(ax: "Axes", samples: "Sequence[Sample]") -> "list[Phase]":
    """A band per contiguous run of samples in one (step, phase), with a ribbon naming the phase; the phases
    drawn, in order."""
    runs: list[tuple[int, int, int, Phase]] = []
    for i, s in enumerate(samples):
        if runs and runs[-1][2] == s.step and runs[-1][3] is s.phase:
            runs[-1] = (runs[-1][0], i, s.step, s.phase)
        else:
            runs.append((i, i, s.step, s.phase))
    seen_phases: list[Phase] = []
    for first, last, _step, phase in runs:
        ax.axvspan(first - 0.5, last + 0.5, color=PHASE_COLORS[phase], alpha=0.10, linewidth=0, zorder=0,
                   gid=f"memprof-phase-{phase.value}")
        # A ribbon along the top edge names the phase even where the stack covers the band.
        ax.axvspan(first - 0.5, last + 0.5, ymin=0.965, ymax=1.0, color=PHASE_COLORS[phase], alpha=0.85,
                   linewidth=0, zorder=3)
        if phase not in seen_phases:
            seen_phases.append(phase)
    return seen_phases


def _step_marks(ax: "Axes", samples: "Sequence[Sample]") -> None:
    """A line at each step boundary and a "step N" label, thinned so labels never collide."""
    step_starts = [(i, s.step) for i, s in enumerate(samples) if i == 0 or samples[i - 1].step != s.step]
    min_gap = max(1.0, 0.07 * len(samples))
    last_label = None
    for i, step in step_starts:
        if i > 0:
            ax.axvline(i - 0.5, color="#555555", linewidth=0.6, alpha=0.6, zorder=3)
        if last_label is None or i - last_label >= min_gap:
            # Inside the axes, under the phase ribbon: above the data (which stays
            # below the peak line at 1/1.15 of the height) and clear of the title.
            ax.annotate(f"step {step}", xy=(i - 0.5, 0.955), xycoords=("data", "axes fraction"),
                        xytext=(3, 0), textcoords="offset points", fontsize=8, va="top", ha="left")
            last_label = i


def _peak_line(ax: "Axes", trace: "Trace", top: float, scale: float) -> None:
    """The session's peak total as a dashed line with its label, and the height of the axes above it."""
    peak_total = trace.peak.total
    if peak_total is not None:
        y = peak_total / scale
        where = _where(trace)
        peak_label = f"peak {format_bytes(peak_total)}" + (f" ({where})" if where else "")
        ax.axhline(y, color="#222222", linestyle="--", linewidth=1.1, zorder=4, label=peak_label,
                   gid="memprof-peak")
        ax.annotate(peak_label, xy=(0.01, y), xycoords=("axes fraction", "data"), xytext=(0, 3),
                    textcoords="offset points", fontsize=8, va="bottom", ha="left", zorder=5,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.7})
        ax.set_ylim(0, y * 1.15)
    else:
        ax.set_ylim(0, top / scale * 1.15)


def _timeline_labels(ax: "Axes", trace: "Trace", unit: str, missing: "list[Category]", partly: "list[Category]",
                     seen_phases: "list[Phase]") -> None:
    """The axes' labels, the title (what was not measured), one legend and the grid."""
    peak_total = trace.peak.total
    ax.set_xlabel("profiling events (module and phase boundaries)")
    ax.set_ylabel(f"memory ({unit})")
    n_steps = len(trace.steps)
    dev = trace.device.name if trace.device.type == "cuda" else trace.device.type
    title = f"Memory timeline: {n_steps} step{'s' if n_steps != 1 else ''}, {trace.mode} mode, {dev}"
    sub = []
    if missing:
        sub.append("not measured: " + ", ".join(c.value for c in missing))
    if partly:
        sub.append("partly measured (0 where missing): " + ", ".join(c.value for c in partly))
    if peak_total is None:
        sub.append("peak total not measured")
    ax.set_title(title + ("\n" + "; ".join(sub) if sub else ""), fontsize=10, loc="left")

    from matplotlib.patches import Patch

    handles, texts = ax.get_legend_handles_labels()
    # One legend (a second one added with add_artist would escape the layout):
    # top of the stack first, as the eye reads it, then the peak line, then the phases.
    cat_pairs = [(h, t) for h, t in zip(handles, texts) if h.get_gid() != "memprof-peak"]
    peak_pairs = [(h, t) for h, t in zip(handles, texts) if h.get_gid() == "memprof-peak"]
    phase_pairs = [(Patch(color=PHASE_COLORS[p], alpha=0.6), f"{p.value} (band)") for p in Phase if p in seen_phases]
    pairs = cat_pairs[::-1] + peak_pairs + phase_pairs
    ax.legend([h for h, _ in pairs], [t for _, t in pairs], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3, zorder=1)


def plot_modules(trace: "Trace", top: int = 15, ax: "Axes | None" = None, *,
                 include_own: bool = True) -> "Figure | SubFigure":
    """Horizontal bars per module: saved activations, parameters and (where measured) peak forward.

    Rows are leaf modules and, with ``include_own``, the own share of each
    container (what ops in its own ``forward`` saved; see the row label
    "own ops"), so that no byte is drawn twice. The ``top`` rows by saved
    activations (then parameters) are shown, largest at the top.
    """
    trace = as_trace(trace)
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise InvalidArgumentError(f"top must be a positive int, got {top!r}")
    rows = own_rows(trace, include_own)
    if not rows:
        raise NotMeasuredError("this trace has no module records; profile a model with at least one forward")
    rows.sort(key=lambda r: (-(r["activations"] or 0), -(r["parameters"] or 0), r["label"]))
    rows = rows[:top]
    series: "list[tuple[OwnFigure, str, str]]" = [
        ("activations", "saved activations", CATEGORY_COLORS[Category.ACTIVATIONS]),
        ("parameters", "parameters", CATEGORY_COLORS[Category.WEIGHTS])]
    if any(r["peak_forward"] is not None for r in rows):
        series.append(("peak_forward", "peak forward (rise during the call)", CATEGORY_COLORS[Category.TEMPORARIES]))

    fig, ax = _new_axes(ax, (10, 1.6 + 0.42 * len(rows)))
    largest = max([r[k] or 0 for r in rows for k, _, _ in series] + [1])
    unit, scale = _unit(largest)
    height = 0.8 / len(series)
    for j, (key, label, color) in enumerate(series):
        ys = [i + (j - (len(series) - 1) / 2) * height for i in range(len(rows))]
        # A figure that was not measured gets no bar (not a zero-length one labelled 0).
        pts = [(y, v / scale) for y, v in zip(ys, (r[key] for r in rows)) if v is not None]
        ax.barh([p[0] for p in pts], [p[1] for p in pts], height=height, color=color, label=label,
                gid=f"memprof-modules-{key}")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([clip_path(one_line(r["label"]), 48) for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"memory ({unit})")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    n = len(rows)
    ax.set_title(f"Top {n} module{'s' if n != 1 else ''} by saved activations "
                 f"({trace.mode} mode; activations summed over a step's calls)", fontsize=10, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def plot_reconciliation(rec: "Reconciliation", ax: "Axes | None" = None) -> "Figure | SubFigure":
    """A waterfall from the formula total to the measured total through the named causes (and what they
    leave unexplained)."""
    total = rec.total
    steps: list[tuple[str, "int | None"]] = [("formula", total.formula)]
    steps += [(f"{c.category.value}: {c.name}", c.bytes) for c in rec.explanations]
    steps.append(("measured", total.measured))
    return plot_waterfall(steps, ax=ax)


def _checked_steps(steps: Sequence[tuple[str, "int | None"]]) -> "list[tuple[str, int | None]]":
    """``steps`` as a list, each a (label, bytes or None) pair, at least a start and an end; else one error."""
    steps = list(steps)
    if len(steps) < 2:
        raise InvalidArgumentError(
            "plot_waterfall needs at least a start and an end: [(label, bytes), ..., (label, bytes)]")
    for item in steps:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and (item[1] is None or (isinstance(item[1], (int, float)) and not isinstance(item[1], bool)))):
            raise InvalidArgumentError(f"each waterfall step is (label: str, bytes: int | None), got {item!r}")
    return steps


def plot_waterfall(steps: Sequence[tuple[str, "int | None"]], ax: "Axes | None" = None, *,
                   title: str = "From formula to measurement") -> "Figure | SubFigure":
    """A waterfall from a starting total through named deltas to an end total.

    ``steps`` is a list of ``(label, bytes)``: the first item is the starting
    total (for example the formula), the last the end total (the measured
    figure), and the ones between are signed deltas. Increases and decreases
    get their own colors; each bar is labelled with its size. If the deltas do
    not add up from start to end, the remainder is drawn as an extra
    "unexplained" bar so the chart never lies. A ``None`` delta is drawn as an
    empty slot labelled "not measured".
    """
    steps = _checked_steps(steps)
    (start_label, start), *middle, (end_label, end) = steps
    if start is None or end is None:
        raise InvalidArgumentError("the start and end of a waterfall must be measured byte counts, not None")
    middle = list(middle)
    remainder = end - start - sum(v for _, v in middle if v is not None)
    if remainder:
        middle.append(("unexplained", remainder))

    fig, ax = _new_axes(ax, (max(6.0, 1.1 * (len(middle) + 2) + 2), 4.8))
    running = start
    levels = [running]
    for _, v in middle:
        running += v or 0
        levels.append(running)
    unit, scale = _unit(max([abs(start), abs(end)] + [abs(x) for x in levels] + [1]))

    labels = [start_label] + [lab for lab, _ in middle] + [end_label]
    x = list(range(len(labels)))
    ax.bar(0, start / scale, color=WATERFALL_COLORS["total"], width=0.6, gid="memprof-waterfall-start")
    ax.bar(len(labels) - 1, end / scale, color=WATERFALL_COLORS["total"], width=0.6, gid="memprof-waterfall-end")
    texts = [(0, start / scale, format_bytes(start)), (len(labels) - 1, end / scale, format_bytes(end))]
    level = start
    used = {"total"}
    for i, (lab, v) in enumerate(middle, start=1):
        if v is None:
            texts.append((i, level / scale, "not measured"))
            continue
        kind = "up" if v >= 0 else "down"
        if lab.strip().lower().startswith("unexplained"):
            kind = "unexplained"
        used.add(kind)
        bottom = level if v >= 0 else level + v
        ax.bar(i, abs(v) / scale, bottom=bottom / scale, color=WATERFALL_COLORS[kind], width=0.6,
               gid=f"memprof-waterfall-{kind}")
        sign = "+" if v > 0 else ""
        texts.append((i, max(level, level + v) / scale, sign + format_bytes(v)))
        # Connector from this bar's end level to the next bar.
        ax.plot([i - 0.3, i + 1.3], [(level + v) / scale] * 2, color="#777777", linewidth=0.7, zorder=1)
        level += v
    ax.plot([-0.3, 1.3], [start / scale] * 2, color="#777777", linewidth=0.7, zorder=1)
    for xi, yi, text in texts:
        ax.annotate(text, xy=(xi, yi), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(x)
    tilt = len(labels) > 4 or max(len(lab) for lab in labels) > 14
    ax.set_xticklabels(labels, rotation=30 if tilt else 0, ha="right" if tilt else "center",
                       rotation_mode="anchor", fontsize=8)
    lo = min(0.0, min(levels) / scale)
    hi = max(levels + [end, start]) / scale
    ax.set_ylim(lo, hi * 1.12 if hi > 0 else 1)
    ax.set_ylabel(f"memory ({unit})")
    ax.axhline(0, color="#777777", linewidth=0.6)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(title, fontsize=10, loc="left")
    from matplotlib.patches import Patch

    names = {"total": "total", "up": "adds memory", "down": "saves memory", "unexplained": "unexplained"}
    ax.legend(handles=[Patch(color=WATERFALL_COLORS[k], label=names[k]) for k in names if k in used],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig
