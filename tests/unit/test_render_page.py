"""The standalone HTML page (memprof.render.page) of a hand-built trace: one self-contained document whose
body is the notebook view, then the reconciliation, then the versions."""

from __future__ import annotations

import re

from memprof.record.trace import SCHEMA_VERSION
from memprof.render.html import report_html
from memprof.render.page import report_page as render_page
from memprof.report.reports import page_reconciliation

from factories import full_trace, trace


def report_page(t) -> str:
    """The page as the facade makes it: the renderer runs no analysis, and is handed the reconciliation."""
    return render_page(t, page_reconciliation(t))


def test_the_page_is_the_notebook_view_and_the_reconciliation_in_one_document():
    t = full_trace()
    page = report_page(t)
    assert page.startswith('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
                           'content="width=device-width, initial-scale=1"><title>memprof report (cpu)</title><style>')
    # The footer names the schema the trace is written in (the current one: factories build current traces).
    assert page.endswith(f"<footer>memprof 0.0.0 · torch 2.13.0 · trace schema {SCHEMA_VERSION}</footer></body></html>\n")
    body = page[page.index("<h1>memprof report</h1>") + len("<h1>memprof report</h1>"):]
    assert body.startswith(report_html(t))  # the notebook view, exactly
    # Then the reconciliation at the peak (step 0, optimizer): the for-loop step's bound leaves 240 B explained.
    assert "for-loop step&#x27;s formula is an upper bound" in page
    assert len(re.findall(r"<style>", page)) == 1 and "<script" not in page.lower()


def test_a_run_the_formulas_cannot_read_still_gets_a_page_saying_why():
    page = report_page(trace(num_steps=0))
    assert "<p>No reconciliation for this run: " in page
