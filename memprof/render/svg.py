"""The memory timeline as inline SVG: no matplotlib, no script, no external asset.

Drawn for the HTML report and the notebook view alike: one stacked area per measured category over
the memory curve (:mod:`memprof.render.curve`), phases as background bands, the run's peak marked.
Past :data:`MAX_POINTS` moments the curve is thinned to the highest moment of each pixel column, so a
peak is never thinned away, and at most :data:`MAX_DRAWN_BANDS` phase bands are drawn: the file stays small
for any run.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Callable, Sequence

from ..vocabulary import Category, Phase
from ..record.trace import as_trace
from ..units import format_bytes
from .common import CATEGORY_COLORS, PHASE_COLORS, quiet
from .curve import Point, curve, level, phase_times

if TYPE_CHECKING:
    from ..record.trace import Trace

__all__ = ["timeline_svg", "MAX_POINTS", "MAX_DRAWN_BANDS"]

#: Most moments drawn; more are thinned per pixel column, keeping each column's highest.
MAX_POINTS = 1400
_W, _H, _LEFT, _BOTTOM, _TOP = 720, 220, 64, 28, 8


def _thin(points: Sequence[Point], x0: float, span: float, plot_w: float) -> list[Point]:
    if len(points) <= MAX_POINTS:
        return list(points)
    columns: dict[int, Point] = {}
    for pt in points:
        col = int((pt.time_us - x0) / span * plot_w)
        best = columns.get(col)
        if best is None or level(pt.breakdown) > level(best.breakdown):
            columns[col] = pt
    return [columns[c] for c in sorted(columns)]


#: Most phase bands drawn with a tooltip; past it, bands under a pixel are left out and neighbours of
#: the same phase merged, so that any number of phases costs a bounded page.
MAX_BANDS = 600


#: Most phase bands drawn at all: twice the plot's width in pixels, which phases that follow one another never
#: reach (past :data:`MAX_BANDS` each band drawn is a pixel wide or more). Phases that overlap (a trace built
#: by hand: the loader refuses them) could each draw a band as wide as the plot; past this the rest are
#: counted under the plot instead.
MAX_DRAWN_BANDS = 2 * (_W - _LEFT - 8)


def _bands(t: "Trace", x: "Callable[[float], float]") -> tuple[list[tuple[float, float, Phase, str]], int]:
    """The phase bands to draw, and how many more were left out by :data:`MAX_DRAWN_BANDS`."""
    bands: list[tuple[float, float, Phase, str]] = []
    timed = phase_times(t)
    many = len(timed) > MAX_BANDS
    left_out = 0
    for p, start, _, end in timed:
        if p.phase is Phase.OTHER:
            continue
        a, b = x(start), x(end)
        if many and bands and bands[-1][2] is p.phase and a - bands[-1][1] < 1:
            bands[-1] = (bands[-1][0], max(b, bands[-1][1]), p.phase, "")
            continue
        if many and b - a < 1:
            continue
        if len(bands) >= MAX_DRAWN_BANDS:
            left_out += 1
            continue
        bands.append((a, b, p.phase, "" if many else f"{p.phase.value} (step {p.step})"))
    return bands, left_out


def _drawn(points: Sequence[Point]) -> list[Category]:
    """The categories measured at some moment, less those a table leaves out (:func:`quiet`): one pass
    over the moments, which a long run has by the hundred thousand."""
    measured, nonzero = [False] * len(Category), [False] * len(Category)
    for pt in points:
        for i, v in enumerate(pt.breakdown.counts):
            if v is not None:
                measured[i] = True
                nonzero[i] = nonzero[i] or v != 0
    return [c for i, c in enumerate(Category) if measured[i] and not quiet(c, int(nonzero[i]))]


def timeline_svg(trace: "Trace") -> str:
    """The timeline as an ``<svg>`` element ("" when the run recorded no moment)."""
    t = as_trace(trace)
    cv = curve(t)
    if not cv.points:
        return ""
    cats = _drawn(cv.points)
    x0 = cv.points[0].time_us
    span = max(cv.points[-1].time_us - x0, 1e-9)
    plot_w, plot_h = _W - _LEFT - 8, _H - _BOTTOM - _TOP
    points = _thin(cv.points, x0, span, plot_w)
    top = max(level(pt.breakdown) for pt in points) or 1

    def x(time_us: float) -> float:
        return _LEFT + (time_us - x0) / span * plot_w

    def y(value: float) -> float:
        return _TOP + plot_h - value / top * plot_h

    # No xmlns: inline SVG in HTML needs none, and the page then names no URL at all.
    out = [f'<svg viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" '
           f'role="img" aria-label="memory over time by category" style="max-width:100%;height:auto;'
           f'font-family:inherit;font-size:10px">']
    bands, left_out = _bands(t, x)
    for a, b, phase, title in bands:
        tip = f"<title>{html.escape(title)}</title>" if title else ""
        out.append(f'<rect x="{a:.1f}" y="{_TOP}" width="{max(b - a, 0.5):.1f}" height="{plot_h}" '
                   f'fill="{PHASE_COLORS[phase]}" fill-opacity="0.10">{tip}</rect>')
    if left_out:
        out.append(f'<text x="{_LEFT + 4}" y="{_TOP + 22}" fill="currentColor">… {left_out:,} more phase bands '
                   f'not drawn (phases overlap)</text>')
    base = [0.0] * len(points)
    for c in cats:
        upper = [b + (pt.breakdown[c] or 0) for b, pt in zip(base, points)]
        if any(u != b for u, b in zip(upper, base)):
            xs = [x(pt.time_us) for pt in points]
            path = " ".join(f"{a:.1f},{y(v):.1f}" for a, v in zip(xs, upper))
            back = " ".join(f"{a:.1f},{y(v):.1f}" for a, v in zip(reversed(xs), reversed(base)))
            out.append(f'<polygon class="memprof-category" data-category="{c.value}" points="{path} {back}" '
                       f'fill="{CATEGORY_COLORS[c]}" fill-opacity="0.85"><title>{c.value}</title></polygon>')
        base = upper
    peak = max(points, key=lambda pt: level(pt.breakdown))
    peak_v = level(peak.breakdown)
    out.append(f'<line x1="{x(peak.time_us):.1f}" x2="{x(peak.time_us):.1f}" y1="{_TOP}" y2="{_TOP + plot_h}" '
               f'stroke="currentColor" stroke-dasharray="3,3" stroke-opacity="0.7"/>')
    out.append(f'<text x="{min(x(peak.time_us) + 4, _W - 120):.1f}" y="{_TOP + 10}" fill="currentColor">'
               f'peak {html.escape(format_bytes(peak_v))}</text>')
    out.append(f'<line x1="{_LEFT}" x2="{_LEFT}" y1="{_TOP}" y2="{_TOP + plot_h}" stroke="currentColor" '
               f'stroke-opacity="0.5"/><line x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{_TOP + plot_h}" '
               f'y2="{_TOP + plot_h}" stroke="currentColor" stroke-opacity="0.5"/>')
    for frac in (0.0, 0.5, 1.0):
        out.append(f'<text x="{_LEFT - 4}" y="{y(top * frac) + 3:.1f}" text-anchor="end" fill="currentColor">'
                   f'{html.escape(format_bytes(int(top * frac)))}</text>')
    axis = (f"{span / 1000:.1f} ms from the first recorded moment" if cv.timed
            else "phases in order (this trace has no clock)")
    out.append(f'<text x="{_LEFT + plot_w / 2:.1f}" y="{_H - 8}" text-anchor="middle" fill="currentColor">'
               f'{html.escape(axis)}</text>')
    out.append("</svg>")
    return "".join(out)
