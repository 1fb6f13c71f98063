"""Writing the exports (memprof.render.export) of hand-built traces: each file holds exactly what its renderer
returns, and a run with nothing measured is refused before any file is written."""

from __future__ import annotations

import json
import pickle

import pytest

from memprof.errors import NotMeasuredError
from memprof.render.chrome import chrome_trace
from memprof.render.export import export_chrome_trace, export_html, export_memory_viz, html_page
from memprof.render.memory_viz import memory_viz_snapshot
from memprof.render.page import report_page

from factories import timed_trace, trace


def test_each_file_is_what_its_renderer_returns(tmp_path):
    t = timed_trace()
    export_chrome_trace(t, tmp_path / "run.json")
    assert json.loads((tmp_path / "run.json").read_text()) == chrome_trace(t)
    export_memory_viz(t, tmp_path / "run.pickle")
    assert pickle.loads((tmp_path / "run.pickle").read_bytes()) == memory_viz_snapshot(t)
    export_html(t, tmp_path / "run.html")
    assert (tmp_path / "run.html").read_text(encoding="utf-8") == html_page(t) == report_page(t)


@pytest.mark.parametrize("export, what", [(export_chrome_trace, "a Chrome trace"),
                                          (export_memory_viz, "a memory_viz snapshot"),
                                          (export_html, "an HTML report")])
def test_a_run_with_no_phase_is_refused_and_nothing_is_written(tmp_path, export, what):
    with pytest.raises(NotMeasuredError) as info:
        export(trace(num_steps=0), tmp_path / "out")
    assert str(info.value) == (f"nothing to export as {what}: the run recorded no phase (nothing ran inside the "
                               "profile, or a schedule recorded no step); profile at least one forward, backward "
                               "or optimizer step")
    assert list(tmp_path.iterdir()) == []
