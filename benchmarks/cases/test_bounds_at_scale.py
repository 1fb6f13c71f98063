"""The standalone page of the worst file the loader accepts (20,000 steps, every text at its cap) stays under
2 MB. The suite holds the worst trace built by hand to the same bound (tests/integration/test_page_bound.py)."""

from __future__ import annotations

import memprof

from test_page_bound import LIMIT, _size, _worst


def test_the_worst_file_the_loader_accepts_makes_a_bounded_page(tmp_path):
    # Phases one after another (the loader refuses overlapping ones), texts of 2,100 characters to keep the file
    # small: every text still cut.
    t = _worst(20_000, overlap=False, text='"' * 2_100, notes=200, modules=200)
    path = tmp_path / "t.json"
    memprof.Report(t).save(path)
    loaded = memprof.load(path).trace
    assert len(loaded.steps) == 20_000 and len(loaded.notes) == 200
    assert _size(loaded) < LIMIT
