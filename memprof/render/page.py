"""The report as one standalone HTML file: readable offline, attachable to a bug report.

Everything is inline (CSS in one ``<style>`` block, the timeline as SVG); no script, no font, no
network request. The body is the notebook view (:func:`memprof.render.html.report_html`: peak
composition, a generation's figures, timeline, phases, modules, notes) plus the reconciliation against
the formulas; a run that ended in an out-of-memory error leads with what was live then.

The page is bounded whatever the trace holds (a file of any size, a trace built by hand): every text is cut
at :data:`~memprof.render.html.MAX_TEXT` characters (a name in a table cell at ``MAX_CELL``), which escape
to at most 6 bytes each; every list is cut at a fixed count (40 phases, 8 modules, 8 modules live at an
error, 50 notes of :data:`~memprof.render.html.MAX_NOTES_TEXT` characters together, the reconciliation's
rows per category); the timeline draws at most :data:`~memprof.render.svg.MAX_POINTS` moments per category
and :data:`~memprof.render.svg.MAX_DRAWN_BANDS` phase bands. What a cap leaves out is counted on the page.
The worst trace tests/integration/test_page_bound.py builds makes under 1 MB.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..record.trace import as_trace
from .html import _e, reconciliation_html, report_html

if TYPE_CHECKING:
    from ..analyse.generation import GenerationSummary
    from ..analyse.reconciler import Reconciliation
    from ..record.trace import Trace

__all__ = ["report_page"]

_CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 24px auto;
       max-width: 64em; padding: 0 16px; color: #1f1f1f; background: #ffffff; }
@media (prefers-color-scheme: dark) { body { color: #e6e6e6; background: #1e1e1e; } }
h1 { font-size: 18px; margin: 0 0 4px 0; }
h2 { font-size: 14px; margin: 18px 0 4px 0; }
table { border-collapse: collapse; font-size: 12px; }
td, th { padding: 2px 10px; border-bottom: 1px solid rgba(128,128,128,0.25); }
footer { margin-top: 24px; font-size: 11px; opacity: 0.7; }
"""


def report_page(trace: "Trace", reconciliation: "Reconciliation | str | None" = None,
                levers: "Sequence[str]" = (), generation: "GenerationSummary | None" = None) -> str:
    """The whole HTML document (a str; :meth:`memprof.Report.to_html` returns it, ``export_html`` writes it).
    Its body is exactly what a notebook shows for the report (``Report._repr_html_``), then ``reconciliation``:
    the run's :class:`~memprof.analyse.reconciler.Reconciliation`, or why there is none (a str), which the
    facade computes (:func:`memprof.report.reports.page_reconciliation`); None leaves it out. ``levers``: an
    out-of-memory run's (:func:`memprof.report.reports.levers`), listed under what was live; ``generation``: a
    generation's summary (:func:`memprof.analyse.generation.generation_summary`), its section."""
    t = as_trace(trace)
    parts = ['<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<title>memprof report ({_e(t.device.name or t.device.type)})</title>",
             f"<style>{_CSS}</style></head><body>",
             "<h1>memprof report</h1>"]
    parts.append(report_html(t, levers=levers, generation=generation))
    parts.append(_reconciliation(reconciliation))
    parts.append(f"<footer>memprof {_e(t.memprof_version)} · torch {_e(t.torch_version)} · "
                 f"trace schema {t.schema_version}</footer></body></html>\n")
    return "".join(parts)


def _reconciliation(rec: "Reconciliation | str | None") -> str:
    if rec is None:
        return ""
    if isinstance(rec, str):  # e.g. a run whose precision or optimizer the formulas do not know
        return f"<p>No reconciliation for this run: {_e(rec)}</p>"
    return reconciliation_html(rec)
