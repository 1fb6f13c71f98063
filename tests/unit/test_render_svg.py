"""The timeline as SVG (memprof.render.svg) of a hand-built timed step: the phase bands, one stacked
polygon per category held, the peak marker and the axes, at the coordinates the figures give.

The plot area runs from x = 64 to 712 (648 px for 0-100 us: 6.48 px per us) and from y = 192 (0 B) up to
y = 8 (432 B, the peak: 184 px for 432 B)."""

from __future__ import annotations

import re

from memprof.render.svg import timeline_svg

from factories import timed_trace


def test_the_timeline_draws_each_phase_category_and_the_peak_where_the_figures_put_them():
    svg = timeline_svg(timed_trace())
    assert svg.startswith('<svg viewBox="0 0 720 220" width="720" height="220" role="img" '
                          'aria-label="memory over time by category"') and svg.endswith("</svg>")
    # Bands: forward 0-50 us = x 64 + 324 px, backward 50-100 us from x 388.
    assert ('<rect x="64.0" y="8" width="324.0" height="184" fill="#4C72B0" fill-opacity="0.10">'
            '<title>forward (step 0)</title></rect>') in svg
    assert ('<rect x="388.0" y="8" width="324.0" height="184" fill="#DD8452" fill-opacity="0.10">'
            '<title>backward (step 0)</title></rect>') in svg
    # Only categories that hold bytes at some moment are drawn (buffers and optimizer state never do).
    assert re.findall(r'data-category="(\w+)"', svg) == ["weights", "gradients", "activations", "inputs",
                                                         "temporaries"]
    # Weights, 144 B all along: y = 192 - 184 * 144 / 432 = 130.7, at the eight moments (0, 10, 40, 45, 50,
    # 50, 70 and 100 us -> x 64.0, 128.8, 323.2, 355.6, 388.0, 388.0, 517.6, 712.0), then back along y = 192.
    assert ('points="64.0,130.7 128.8,130.7 323.2,130.7 355.6,130.7 388.0,130.7 388.0,130.7 517.6,130.7 712.0,130.7 '
            '712.0,192.0 517.6,192.0 388.0,192.0 388.0,192.0 355.6,192.0 323.2,192.0 128.8,192.0 64.0,192.0" '
            'fill="#4C72B0"') in svg
    # The top of the stack at the run's peak (70 us, x 517.6): 432 B, y = 8.0.
    assert "517.6,8.0" in svg
    assert ('<line x1="517.6" x2="517.6" y1="8" y2="192" stroke="currentColor" stroke-dasharray="3,3" '
            'stroke-opacity="0.7"/><text x="521.6" y="18" fill="currentColor">peak 432 B</text>') in svg
    # The y axis: 0, half of the peak (216 B) and the peak.
    assert re.findall(r'text-anchor="end" fill="currentColor">([^<]+)</text>', svg) == ["0 B", "216 B", "432 B"]
    assert ">0.1 ms from the first recorded moment</text>" in svg
