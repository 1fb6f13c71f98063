"""HTML views for notebooks: ``Report._repr_html_`` and tables.

The output is one self-contained fragment: inline ``style`` attributes only
(no ``<style>`` block, no JavaScript, no external assets), so it survives
notebook sanitizers and renders the same in JupyterLab, classic Notebook,
VS Code and exported HTML. Text color is inherited from the notebook's theme;
borders, tracks and muted text use translucent grays and the bars use the
mid-tone :data:`memprof.render.common.CATEGORY_COLORS`, which read on light and dark
backgrounds alike. Every piece of text from the trace is escaped.
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Iterable, Sequence

from ..vocabulary import Category, DEVICE_CATEGORIES
from ..errors import InvalidArgumentError, is_interrupt
from ..record.aliases import Cell
from ..record.trace import Breakdown, ModuleRecord, as_trace
from ..units import format_bytes, one_line, printable
from .common import (CATEGORY_COLORS, NO_ESTIMATE, NO_FORMULA, NOT_MEASURED, OwnFigure, OwnRow, module_columns,
                     own_rows, quiet, signed, size)
from .svg import timeline_svg
from .ranks import ranks_text
from .text import generation_head, generation_rows, oom_lines, rank_line

if TYPE_CHECKING:
    import pandas as pd

    from ..analyse.compare import Diff
    from ..analyse.generation import GenerationSummary
    from ..analyse.merge import Merged, RankClassLike
    from ..analyse.reconciler.per_rank import RankTable
    from ..record.parts import PhaseRecord
    from ..analyse.reconciler import Reconciliation
    from ..record.trace import Trace

__all__ = ["report_html", "frame_html", "breakdown_html", "reconciliation_html", "diff_html", "merged_html"]

_ROOT = ("font-family:var(--jp-ui-font-family, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif);"
         "font-size:13px;line-height:1.45;color:inherit;background:transparent;max-width:60em")
_TABLE = "border-collapse:collapse;margin:2px 0 14px 0;font-size:12px;color:inherit;background:transparent"
_TH = ("padding:3px 10px;text-align:{align};font-weight:600;border-bottom:1px solid rgba(128,128,128,0.55);"
       "background:transparent;color:inherit;white-space:nowrap")
_TD = ("padding:2px 10px;text-align:{align};border-bottom:1px solid rgba(128,128,128,0.2);"
       "background:transparent;color:inherit;white-space:nowrap;font-variant-numeric:tabular-nums")
_H = "font-size:13px;font-weight:600;margin:10px 0 2px 0"
_MUTED = "opacity:0.7;font-style:italic"
_TRACK = ("display:inline-block;width:12em;height:0.75em;background:rgba(128,128,128,0.2);border-radius:2px;"
          "vertical-align:middle")
_NOT_MEASURED = f'<span style="{_MUTED}">{NOT_MEASURED}</span>'

#: Columns :func:`frame_html` formats as byte counts when they hold integers.
BYTE_COLUMNS = frozenset(
    [c.value for c in Category]
    + ["total", "start", "peak", "end", "bytes", "parameters", "gradients", "activations",
       "peak_forward", "temporaries_forward", "peak_backward", "temporaries_backward", "a", "b", "delta"]
)
#: Columns :func:`frame_html` formats as percentages: fractions (0..1) and percents (0..100).
FRACTION_COLUMNS = frozenset(["share"])
PERCENT_COLUMNS = frozenset(["delta_pct"])


#: Most notes a page lists (a run writes a few; a file may hold any number).
MAX_NOTES = 50
#: Most characters of one piece of text a page shows (an exception message, a note, a module's path):
#: longer ones end in a marker that says how much was left out, so that no text makes the page large.
MAX_TEXT = 2000
#: Most characters of a name in a table cell (a module's path or type): a path this long is cut, not read.
MAX_CELL = 500
#: Most characters the notes show together (a run's notes are a few hundred characters each): past it a note
#: is cut, and the notes after it are counted.
MAX_NOTES_TEXT = 20_000


def _e(value: object, limit: int = MAX_TEXT) -> str:
    """Text for the page: bounded (at most ``limit`` characters, see :data:`MAX_TEXT`), with control characters
    (a NUL in an exception message), bidirectional overrides and lone surrogates shown as escapes, as in the
    text report. An escape is at most 6 characters of the page per character of the text (``&quot;``,
    ``\\u202e``)."""
    text = str(value)
    if len(text) > limit:
        text = f"{text[:limit]}… ({len(text) - limit:,} more characters)"
    return html.escape(printable(text), quote=True)


def _notes_html(notes: Sequence[str]) -> str:
    """The notes as a list: at most :data:`MAX_NOTES` of them and :data:`MAX_NOTES_TEXT` characters together,
    the rest counted."""
    items, budget = [], MAX_NOTES_TEXT
    for note in notes[:MAX_NOTES]:
        if budget <= 0:
            break
        items.append(f"<li>{_e(note, min(MAX_TEXT, budget))}</li>")
        budget -= min(len(note), MAX_TEXT)
    if len(notes) > len(items):
        items.append(f'<li style="{_MUTED}">… {len(notes) - len(items):,} more in report.trace.notes</li>')
    return f'<div style="{_H}">Notes</div><ul style="margin:2px 0 8px 1.2em;padding:0">' + "".join(items) + "</ul>"


def _title(text: str) -> str:
    return f'<div style="{_H}">{_e(text)}</div>'



def _bytes(n: "int | None") -> str:
    return _NOT_MEASURED if n is None else _e(format_bytes(n))


def _swatch(cat: Category) -> str:
    return (f'<span style="display:inline-block;width:0.75em;height:0.75em;border-radius:2px;'
            f'margin-right:0.45em;vertical-align:middle;background:{CATEGORY_COLORS[cat]}"></span>')


def _table(headers: Sequence[tuple[str, str]], rows: Iterable[Sequence[str]], *,
           bold_rows: "set[int] | None" = None) -> str:
    """``headers``: (escaped label, align); ``rows``: cells as ready HTML."""
    out = [f'<table style="{_TABLE}"><thead><tr>']
    for label, align in headers:
        out.append(f'<th style="{_TH.format(align=align)}">{label}</th>')
    out.append("</tr></thead><tbody>")
    for i, row in enumerate(rows):
        weight = ";font-weight:600" if bold_rows and i in bold_rows else ""
        out.append("<tr>")
        for (_, align), cell in zip(headers, row):
            out.append(f'<td style="{_TD.format(align=align)}{weight}">{cell}</td>')
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _share_bar(fraction: float, color: str) -> str:
    pct = max(0.0, min(100.0, 100.0 * fraction))
    return (f'<span style="{_TRACK}"><span style="display:block;height:100%;width:{pct:.1f}%;'
            f'background:{color};border-radius:2px"></span></span>')


def breakdown_html(bd: Breakdown, *, device_type: str = "cpu") -> str:
    """A breakdown as a table: category, bytes, share of the total and a bar of that share.

    Categories that were not measured say so (never 0); the device-only rows
    say why on a device without an accelerator allocator.
    """
    rows = []
    for cat in Category:
        v = bd[cat]
        if quiet(cat, v):
            continue
        if v is None:
            why = ""
            if cat in DEVICE_CATEGORIES and device_type != "cuda":
                why = (" (no accelerator allocator)" if cat is Category.ALLOCATOR_OVERHEAD
                       else " (no accelerator driver)")
            rows.append([_swatch(cat) + _e(cat.value), _NOT_MEASURED + f'<span style="{_MUTED}">{_e(why)}</span>',
                         "", ""])
            continue
        if bd.total:
            frac = v / bd.total
            share, bar = f"{100 * frac:.1f}%", _share_bar(frac, CATEGORY_COLORS[cat])
        else:
            share, bar = "", ""
        rows.append([_swatch(cat) + _e(cat.value), _e(format_bytes(v)), share, bar])
    rows.append(["<b>total</b>", f"<b>{_bytes(bd.total)}</b>", "100.0%" if bd.total else "", ""])
    return _table([("category", "left"), ("bytes", "right"), ("share", "right"), ("", "left")], rows)


def _stacked_bar(bd: Breakdown, width_em: float) -> str:
    """A bar of ``width_em`` split by the measured categories of ``bd`` (a tooltip names each part)."""
    parts = [(c, v) for c, v in bd.measured().items() if v]
    total = sum(v for _, v in parts)
    if not total or width_em <= 0:
        return ""
    segs = "".join(
        f'<span title="{_e(c.value)}: {_e(format_bytes(v))}" style="display:inline-block;height:100%;'
        f'width:{100 * v / total:.2f}%;background:{CATEGORY_COLORS[c]}"></span>'
        for c, v in parts
    )
    return (f'<span style="display:inline-flex;width:{width_em:.2f}em;height:0.75em;vertical-align:middle;'
            f'border-radius:2px;overflow:hidden">{segs}</span>')


def _phases_html(trace: "Trace", max_phases: int) -> str:
    recs = list(trace.phases)
    if not recs:
        return ""
    highest = max((r.peak.total or 0) for r in recs) or max(sum(r.peak.measured().values()) for r in recs) or 1
    shown: "list[PhaseRecord | None]" = list(recs)
    hidden = 0
    if len(recs) > max_phases:
        half = max(1, max_phases // 2)
        hidden = len(recs) - 2 * half
        shown = [*recs[:half], None, *recs[-half:]]
    rows, bold = [], set()
    peak = trace.peak_record()
    for rec in shown:
        if rec is None:
            rows.append([f'<span style="{_MUTED}">… {hidden} more (report.phases() has all)</span>',
                         "", "", "", "", "", ""])
            continue
        label = rec.phase.value + (f" #{rec.occurrence}" if rec.occurrence else "")
        level = rec.peak.total if rec.peak.total is not None else sum(rec.peak.measured().values())
        largest = [(c, v) for c, v in rec.peak.measured().items() if v]
        big = max(largest, key=lambda cv: cv[1]) if largest else None
        if rec is peak:
            bold.add(len(rows))
        rows.append([
            _e(rec.step), _e(label), _bytes(rec.start.total), _bytes(rec.peak.total), _bytes(rec.end.total),
            (_swatch(big[0]) + _e(f"{big[0].value} {format_bytes(big[1])}")) if big else "",
            _stacked_bar(rec.peak, 10.0 * level / highest),
        ])
    headers = [("step", "right"), ("phase", "left"), ("start", "right"), ("peak", "right"), ("end", "right"),
               ("largest at peak", "left"), ("composition at peak", "left")]
    return _table(headers, rows, bold_rows=bold)


def _module_rows(trace: "Trace", top: int, by: OwnFigure) -> list[tuple[str, ModuleRecord | None, OwnRow]]:
    mods = {m.path: m for m in trace.modules}
    rows = []
    for r in own_rows(trace, include_own=True):  # the same rows the module plot draws
        path = r["path"]
        rows.append((path, mods[path] if not r["own"] else None, r))
    rows.sort(key=lambda x: (-(x[2][by] or 0), -(x[2]["parameters"] or 0), x[0]))
    return rows[:top]


def _modules_html(trace: "Trace", top: int) -> str:
    """The top modules' table, with the columns the text report shows for the run (see
    :func:`~memprof.render.common.module_columns`)."""
    cols = module_columns(trace)
    rows = _module_rows(trace, top, "activations" if cols.saved else "peak_forward")
    if not rows:
        return ""
    dash = f'<span style="{_MUTED}" title="not defined for a container\'s own ops">–</span>'
    out = []
    for path, rec, r in rows:
        typ = r["type"] + (" (own ops)" if r["own"] else "")
        row = [_e(path, MAX_CELL), _e(typ, MAX_CELL), _bytes(r["parameters"])]
        if cols.saved:
            row.append(_bytes(r["activations"]))
        row.append(_bytes(rec.peak_forward) if rec else dash)
        if cols.backward:
            row.append(_bytes(rec.peak_backward) if rec else dash)
        out.append(row)
    headers = [("module", "left"), ("type", "left"), ("params", "right")] + (
        [("saved act", "right")] if cols.saved else []) + [("peak fwd", "right")] + (
        [("peak bwd", "right")] if cols.backward else [])
    return _title(cols.title) + _table(headers, out)


def _generation_html(g: "GenerationSummary | None") -> str:
    """The text report's "Generation" section (a :func:`memprof.analyse.generation.generation_summary`, its
    lines from :mod:`.text`): a heading and a table of its figures ("" for a run that did not decode with a
    cache)."""
    if g is None:
        return ""
    return (f'<div style="{_H}">{_e(generation_head(g))}</div>'
            + _table([("generation", "left"), ("", "right")], [[_e(k), _e(v)] for k, v in generation_rows(g)]))


def report_html(trace: "Trace", *, top_modules: int = 8, max_phases: int = 40, levers: Sequence[str] = (),
                generation: "GenerationSummary | None" = None) -> str:
    """The report as a self-contained HTML fragment (what ``Report._repr_html_`` shows).

    Title line (steps, mode, device, torch), the peak breakdown with bars of
    each category's share, a generation's figures (as the text report's section),
    the phase table (the row of the global peak in bold, each with a bar of its
    composition scaled to the highest phase), the
    ``top_modules`` modules by saved activations (leaves, plus each
    container's own ops, as :func:`memprof.render.plot.plot_modules` draws them) and
    the notes. Runs with more than ``max_phases`` phases show the first and
    last ones. ``levers``: an out-of-memory run's largest levers, listed under what was live; ``generation``:
    a generation's summary, its section (the facade computes both, :func:`memprof.report.reports.levers`,
    :func:`memprof.analyse.generation.generation_summary`).
    """
    t = as_trace(trace)
    dev = t.device.name if t.device.type == "cuda" else t.device.type
    n = t.num_steps
    parts = [f'<div class="memprof-report" style="{_ROOT}">']
    if t.oom is not None:  # an OOM dump leads with what was live then, and the levers
        parts.append(f'<div style="{_H}">What was live at the out-of-memory error</div>'
                     f'<pre style="white-space:pre-wrap;font-size:12px;margin:2px 0 12px 0;padding:6px 10px;'
                     f'border-left:3px solid #C44E52;background:rgba(196,78,82,0.08)">'
                     + "\n".join(_e(one_line(line)) for line in oom_lines(t, levers)) + "</pre>")
    parts.append(f'<div style="font-size:14px;font-weight:600;margin-bottom:4px">memprof report: '
                 f'{n} step{"s" if n != 1 else ""}, mode {_e(t.mode)}, device {_e(dev)}'
                 f'<span style="font-weight:400;{_MUTED}"> · torch {_e(t.torch_version)}</span></div>')
    if t.distributed is not None:
        parts.append(f'<div style="margin:2px 0;{_MUTED}">{_e(rank_line(t.distributed))}</div>')
    if t.error:
        parts.append(f'<div style="margin:4px 0;color:#C44E52;font-weight:600">'
                     f'profiled code raised {_e(t.error)}</div>')
    where = t.peak_location()
    parts.append(f'<div style="{_H}">Peak {_bytes(t.peak.total)}'
                 + (f'<span style="font-weight:400"> ({_e(", ".join(where))})</span>' if where else "") + "</div>")
    parts.append(breakdown_html(t.peak, device_type=t.device.type))
    if t.live_at_error is not None and t.oom is None:  # an OOM's page leads with it already
        parts.append(f'<div style="{_H}">Live when the error was raised: {_bytes(t.live_at_error.total)}</div>')
        parts.append(breakdown_html(t.live_at_error, device_type=t.device.type))
        if t.live_modules_at_error:
            rows = [[_e(p, MAX_CELL), _e(format_bytes(b))] for p, b in t.live_modules_at_error[:8]]
            parts.append(_table([("created by module", "left"), ("still live", "right")], rows))
    parts.append(_generation_html(generation))
    svg = timeline_svg(t)
    if svg:
        legend = " ".join(f'<span style="white-space:nowrap;margin-right:0.8em">{_swatch(c)}{_e(c.value)}</span>'
                          for c in Category if t.peak[c] is not None)
        parts.append(f'<div style="{_H}">Memory over time <span style="font-weight:400">(phases shaded: forward '
                     f'blue, backward orange, optimizer red)</span></div><div>{svg}</div>'
                     f'<div style="font-size:11px;margin-bottom:8px">{legend}</div>')
    if t.steps:
        parts.append(f'<div style="{_H}">Phases '
                     '<span style="font-weight:400">(bytes at the peak of each phase)</span></div>')
        parts.append(_phases_html(t, max_phases))
    if top_modules > 0:
        parts.append(_modules_html(t, top_modules))
    if t.notes:
        parts.append(_notes_html(t.notes))
    parts.append("</div>")
    return "".join(parts)


def _cell(col: str, value: Cell) -> str:
    missing = value is None
    if not missing:
        try:
            import pandas as pd

            missing = bool(pd.isna(value)) if not isinstance(value, (list, tuple, dict)) else False
        except (TypeError, ValueError) as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            missing = False
    if missing:
        return _NOT_MEASURED
    if col in BYTE_COLUMNS and _is_int(value):
        return _e(format_bytes(int(value)))
    if col in FRACTION_COLUMNS and _is_number(value):
        return _e(f"{100 * float(value):.1f}%")
    if col in PERCENT_COLUMNS and _is_number(value):
        return _e(f"{float(value):+.1f}%")
    return _e(value)


def _is_int(value: object) -> bool:
    try:
        import numpy as np

        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    except ImportError as failure:  # pragma: no cover - numpy comes with pandas
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Cell) -> bool:
    try:
        f = float(value)
    except (TypeError, ValueError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return False
    return not isinstance(value, bool) and math.isfinite(f)


def frame_html(df: "pd.DataFrame", *, max_rows: int = 60) -> str:
    """A DataFrame as a themed, escaped HTML table with byte columns in IEC units.

    Integer cells of the byte columns (:data:`BYTE_COLUMNS`: the categories,
    ``start``, ``peak``, ``end``, ``bytes``, the module figures, ``a``, ``b``,
    ``delta``) are shown with :func:`~memprof.units.format_bytes`; ``share``
    as a percentage, ``delta_pct`` as a signed percentage; missing values as
    "not measured". A named or non-default index becomes the first column.
    Frames longer than ``max_rows`` show their first and last rows.
    """
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        raise InvalidArgumentError(f"frame_html needs a pandas DataFrame, got {type(df).__name__}")
    show_index = not isinstance(df.index, pd.RangeIndex) or df.index.name is not None
    index_name = str(df.index.name) if df.index.name is not None else ""
    headers = ([(_e(index_name), "left")] if show_index else [])
    for col in df.columns:
        numeric = pd.api.types.is_numeric_dtype(df[col])
        headers.append((_e(col), "right" if numeric else "left"))
    n = len(df)
    positions: "list[int | None]" = list(range(n))
    if n > max_rows:
        half = max(1, max_rows // 2)
        positions = list(range(half)) + [None] + list(range(n - half, n))
    rows = []
    for pos in positions:
        if pos is None:
            rows.append([f'<span style="{_MUTED}">… {n - 2 * max(1, max_rows // 2)} more rows</span>']
                        + [""] * (len(headers) - 1))
            continue
        row = [_e(df.index[pos])] if show_index else []
        row.extend(_cell(str(col), df.iloc[pos, j]) for j, col in enumerate(df.columns))
        rows.append(row)
    return f'<div style="{_ROOT}">' + _table(headers, rows) + "</div>"


def reconciliation_html(rec: "Reconciliation") -> str:
    """A reconciliation as HTML: the table (gaps colored) and the explanations."""
    rows = []
    for r in rec.rows:
        if r.formula is None and r.measured is None and r.estimate is None or \
                quiet(r.category, r.formula, r.measured, r.estimate):
            continue
        gap = r.gap
        color = "" if not gap else ("color:#b00020" if gap > 0 else "color:#1b7f3b")
        cells = "".join(f"<td style='text-align:right'>{_e(size(v, missing))}</td>"
                        for v, missing in ((r.formula, NO_FORMULA), (r.estimate, NO_ESTIMATE),
                                           (r.measured, NOT_MEASURED)))
        rows.append(f"<tr><td>{_e(r.category.value)}</td>{cells}"
                    f"<td style='text-align:right;{color}'>{_e(signed(gap))}</td></tr>")
    expl = "".join(f"<li>{_e(str(c))}</li>" for c in rec.explanations)
    return ("<div><b>memprof reconciliation</b> at the " + _e(rec.where)
            + "<table><tr><th>category</th><th>formula</th><th>estimate</th><th>measured</th><th>gap</th></tr>"
            + "".join(rows) + "</table><ul>" + expl + "</ul>" + _rank_table(getattr(rec, "per_rank", None))
            + "</div>")


def _rank_table(table: "RankTable | None") -> str:
    """A rank's per-degree formula (:class:`memprof.analyse.reconciler.per_rank.RankTable`): bytes first, then the
    formula and the named parts of each gap."""
    if table is None:
        return ""
    mesh = " × ".join(f"{n} {s}" for n, s in table.degrees)
    actual = "simulated" if table.simulated else "measured"
    headers = [("category", "left"), ("formula", "right"), (actual, "right"), ("gap", "right"),
               ("per-rank formula", "left")]
    rows = []
    for r in table.rows:
        named = "".join(f"<br><small>{_e(signed(b))} {_e(n)}</small>" for n, b, _ in r.parts)
        rows.append([_e(r.category.value), _e(size(r.value, "not modelled")), _e(size(r.actual, NOT_MEASURED)),
                     _e(signed(r.gap) if r.gap is not None else ""), _e(r.formula) + named])
    notes = "".join(f"<div><small>{_e(n)}</small></div>" for n in table.notes)
    return _title(f"Per rank: rank {table.rank} of {table.world_size}, mesh {mesh}") + _table(headers, rows) + notes


def diff_html(diff: "Diff") -> str:
    """A diff as HTML: the categories' table (with the total), the phases, what only one run has."""
    from .frames import diff_frame, diff_phases_frame

    la, lb = diff.labels
    frame = diff_frame(diff)
    frame.loc["total"] = [diff.total.a, diff.total.b, diff.total.delta, diff.total.delta_pct]
    parts = [f"<div><b>memprof diff</b>: {_e(la)} → {_e(lb)} (breakdown at the {_e(diff.at)})</div>",
             frame_html(frame)]
    if diff.phases:
        parts.append("<div><b>Phases</b> (peak total of each phase)</div>")
        parts.append(frame_html(diff_phases_frame(diff)))
    for label, keys in ((la, diff.only_in_a), (lb, diff.only_in_b)):
        if keys:
            names = ", ".join(f"step {s} {ph.value}" + (f" #{o}" if o else "") for s, ph, o in keys)
            parts.append(f"<div>Only in {_e(label)}: {_e(names)}</div>")
    if diff.notes:
        parts.append("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in diff.notes) + "</ul>")
    return "".join(parts)


def merged_html(merged: "Merged") -> str:
    """The ranks of one run as HTML: the worst rank and the spread, then one row per rank."""
    from .frames import merged_frame

    spread = merged.spread
    kind = "simulated " if getattr(merged, "simulated", False) else ""
    head = (f"<div><b>memprof merge</b>: {len(merged.ranks)} of {merged.world_size} {kind}rank(s); worst rank "
            f"{merged.worst}" + (f"; spread {_e(size(spread[0]))}, max/mean {spread[1]:.3f}" if spread else "")
            + "</div>")
    notes = "".join(f"<div>{_e(n)}</div>" for n in merged.notes)
    return head + frame_html(merged_frame(merged)) + _classes(getattr(merged, "classes", ()), merged.worst) + notes


def _classes(classes: "tuple[RankClassLike, ...]", worst: int) -> str:
    """Simulated rank classes: the ranks each stands for, the one simulated (* the worst), stages, peak, where."""
    if not classes:
        return ""
    headers = [("ranks", "left"), ("simulated", "right"), ("stages", "left"), ("peak", "right"), ("where", "left")]
    rows = [[_e(ranks_text(c.ranks)), f"{c.representative}{' *' if c.representative == worst else ''}",
             _e(",".join(map(str, c.stages)) or "-"), _e(format_bytes(c.peak_bytes)),
             _e(f"step {c.peak_step} {c.peak_phase}")] for c in classes]
    return _title("Rank classes (ranks that hold the same memory)") + _table(headers, rows)
