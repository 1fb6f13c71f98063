"""The HTML report (memprof.render.html) of small runs profiled for real on CPU: its tables, escaping and
what it says was not measured."""

from __future__ import annotations

import re

import pytest

from memprof.vocabulary import Category
from memprof.errors import InvalidArgumentError
from memprof.render.html import frame_html, report_html
from memprof.render.common import CATEGORY_COLORS


def _row(html: str, name: str) -> str:
    """The <tr> of the breakdown table whose first cell ends with ``name``."""
    for row in re.findall(r"<tr>(.*?)</tr>", html):
        first = re.sub(r"<[^>]+>", "", row.split("</td>")[0])
        if first == name:
            return row
    raise AssertionError(f"no row {name!r}")


def test_html_has_categories_and_not_measured_device_rows(mlp8):
    html = report_html(mlp8)
    assert html.startswith('<div class="memprof-report"') and html.endswith("</div>")
    for cat in Category:
        assert cat.value in html
    # CPU: the accelerator-only rows say "not measured", never 0.
    for name in ("allocator_overhead", "outside_torch"):
        row = _row(html, name)
        assert "not measured" in row and ">0 B<" not in row
    assert "memprof report: 2 steps, mode exact, device cpu" in html
    assert "Phases" in html and "Top modules by saved activations" in html
    # Share bars: weights' width is its share of the peak, to one decimal.
    share = 100 * mlp8.peak[Category.WEIGHTS] / mlp8.peak.total
    assert f"width:{share:.1f}%;background:{CATEGORY_COLORS[Category.WEIGHTS]}" in _row(html, "weights")


def test_html_is_self_contained(mlp8):
    html = report_html(mlp8)
    for forbidden in ("<script", "<link", "<img", "http://", "https://", "<style"):
        assert forbidden not in html.lower()


def test_html_escapes_module_paths(root_ops):
    # The root module's own ops (tanh's saved output) make a "<model>" row.
    assert any(m.path == "<model>" and m.activations for m in root_ops.trace.modules)
    html = report_html(root_ops)
    assert "&lt;model&gt;" in html
    assert "<model>" not in html


def test_html_light_mode_says_not_measured(light8):
    html = report_html(light8)
    assert "not measured" in _row(html, "temporaries")
    assert "not measured" in _row(html, "total")
    assert "light mode on CPU" in html  # the trace's note


def test_html_escapes_notes_and_error(mlp8):
    import dataclasses

    trace = dataclasses.replace(mlp8.trace, notes=("a <b>bold</b> & risky note",), error="RuntimeError('<oom>')")
    html = report_html(trace)
    assert "a &lt;b&gt;bold&lt;/b&gt; &amp; risky note" in html
    assert "RuntimeError(&#x27;&lt;oom&gt;&#x27;)" in html


def test_frame_html_formats_bytes_and_missing(mlp8):
    html = frame_html(mlp8.breakdown_frame())
    assert "27.0 KiB" in html  # weights: 27,688 bytes
    assert "not measured" in html
    assert "46.5%" in html  # share column as a percentage
    with pytest.raises(InvalidArgumentError):
        frame_html([1, 2])
