"""The HTML views (memprof.render.html) of hand-built traces: every cell of the breakdown, phase and module
tables as a reader sees them, the share bars, what was not measured, and the escaping of recorded text."""

from __future__ import annotations

import dataclasses
import html
import re

from memprof.render.html import breakdown_html, report_html

from factories import full_trace, timed_trace


def _tables(markup: str) -> list[list[list[str]]]:
    """Each table's rows, each row's cells as text (tags dropped, entities read)."""
    def text(cell):
        return html.unescape(re.sub(r"<[^>]+>", "", cell))

    return [[[text(cell) for cell in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S)]
             for row in re.findall(r"<tr.*?</tr>", table, re.S)]
            for table in re.findall(r"<table.*?</table>", markup, re.S)]


def test_a_breakdown_is_a_table_of_bytes_and_shares_with_device_rows_not_measured():
    markup = breakdown_html(timed_trace().peak)
    # The backward's peak, 432 B: weights and gradients 144 B each (33.3 %), activations 48 (11.1 %),
    # inputs 96 (22.2 %).
    assert _tables(markup) == [[
        ["category", "bytes", "share", ""],
        ["weights", "144 B", "33.3%", ""], ["buffers", "0 B", "0.0%", ""], ["gradients", "144 B", "33.3%", ""],
        ["optimizer_states", "0 B", "0.0%", ""], ["activations", "48 B", "11.1%", ""], ["inputs", "96 B", "22.2%", ""],
        ["temporaries", "0 B", "0.0%", ""],
        ["allocator_overhead", "not measured (no accelerator allocator)", "", ""],
        ["outside_torch", "not measured (no accelerator driver)", "", ""],
        ["total", "432 B", "100.0%", ""]]]
    # Each share bar is as wide as its share, in its category's color.
    assert "width:33.3%;background:#4C72B0" in markup and "width:11.1%;background:#55A868" in markup
    assert "<b>432 B</b>" in markup


def test_the_report_shows_its_header_peak_phases_modules_and_notes():
    markup = report_html(full_trace())
    assert markup.startswith('<div class="memprof-report"') and markup.endswith("</div>")
    heading = r'<div style="font-size:1[34]px;font-weight:600[^"]*">(.*?)</div>'
    heads = [re.sub(r"<[^>]+>", "", h) for h in re.findall(heading, markup)]
    assert heads == ["memprof report: 5 steps, mode exact, device cpu · torch 2.13.0", "Peak 728 B (step 0, optimizer)",
                     "Memory over time (phases shaded: forward blue, backward orange, optimizer red)",
                     "Phases (bytes at the peak of each phase)", "Top modules by saved activations", "Notes"]
    peak, phases, modules = _tables(markup)
    # 728 B at the optimizer's peak: 144 + 144 + 296 + 144; 144 / 728 = 19.8 %, 296 / 728 = 40.7 %.
    assert peak[1:8] == [["weights", "144 B", "19.8%", ""], ["buffers", "0 B", "0.0%", ""],
                         ["gradients", "144 B", "19.8%", ""], ["optimizer_states", "296 B", "40.7%", ""],
                         ["activations", "0 B", "0.0%", ""], ["inputs", "0 B", "0.0%", ""],
                         ["temporaries", "144 B", "19.8%", ""]]
    assert phases == [["step", "phase", "start", "peak", "end", "largest at peak", "composition at peak"],
                      ["0", "forward", "144 B", "288 B", "240 B", "weights 144 B", ""],
                      ["0", "backward", "240 B", "336 B", "288 B", "weights 144 B", ""],
                      ["0", "optimizer", "288 B", "728 B", "584 B", "optimizer_states 296 B", ""]]
    assert modules == [["module", "type", "params", "saved act", "peak fwd", "peak bwd"],
                       ["fc", "Linear", "144 B", "96 B", "288 B", "432 B"]]
    assert "<li>a note with \u00e9 and a newline\nin it</li>" in markup
    for outside in ("<script", "<link", "<img", "http://", "https://", "<style"):
        assert outside not in markup.lower()


def test_text_a_trace_carries_is_escaped():
    t = dataclasses.replace(full_trace(), notes=("a <b>bold</b> & risky note",), error="RuntimeError('<oom>')")
    markup = report_html(t)
    assert "a &lt;b&gt;bold&lt;/b&gt; &amp; risky note" in markup and "<b>bold</b>" not in markup
    assert "RuntimeError(&#x27;&lt;oom&gt;&#x27;)" in markup
