"""diff() of two runs profiled for real on CPU: categories, phases, unmatched phases, its text and tables."""

from __future__ import annotations

import re

import pytest

from memprof import Diff, diff
from memprof.errors import InvalidArgumentError
from memprof.vocabulary import Category

from runs import run_mlp


def test_diff_batch_8_vs_16(mlp8, mlp16):
    d = diff(mlp8, mlp16)
    assert isinstance(d, Diff)
    # Same model: weights 27,688 B (32*64 + 64 + 64*64 + 64 + 64*10 + 10 = 6,922 floats * 4) and
    # gradients unchanged.
    assert d[Category.WEIGHTS].a == d[Category.WEIGHTS].b == 27_688
    assert d[Category.WEIGHTS].delta == 0 and d[Category.GRADIENTS].delta == 0
    # Inputs: both batches stay alive in the list, each x (batch x 32 float32) and y (batch int64):
    # 8 more samples * (32 * 4 + 8) bytes * 2 batches = 2,176 bytes more (2,176 -> 4,352).
    assert (d[Category.INPUTS].a, d[Category.INPUTS].b, d[Category.INPUTS].delta) == (2176, 4352, 2176)
    assert d[Category.INPUTS].delta_pct == 100.0
    # Every category and the total are the reports' own peak figures, b - a.
    for cat in Category:
        a, b = mlp8.peak[cat], mlp16.peak[cat]
        entry = d[cat]
        assert (entry.a, entry.b) == (a, b)
        assert entry.delta == (None if a is None else b - a)
    assert d[Category.ALLOCATOR_OVERHEAD].delta is None and d[Category.ALLOCATOR_OVERHEAD].delta_pct is None
    assert d.total.delta == mlp16.peak.total - mlp8.peak.total
    # Phases: same loop, so every (step, phase, occurrence) matches.
    assert len(d.phases) == len(mlp8.trace.phases) and not d.only_in_a and not d.only_in_b
    for p, ra, rb in zip(d.phases, mlp8.trace.phases, mlp16.trace.phases):
        assert p.key == (ra.step, ra.phase, ra.occurrence)
        assert p.delta == rb.peak.total - ra.peak.total
    # grew(): exactly the categories with a positive delta, with their deltas.
    grown = [(c, mlp16.peak[c] - mlp8.peak[c]) for c in Category
             if mlp8.peak[c] is not None and mlp16.peak[c] - mlp8.peak[c] > 0]
    assert d.grew() == grown and (Category.INPUTS, 2176) in grown
    assert (Category.INPUTS, 2176) in d.grew(tolerance="2 KiB")  # 2,048 < 2,176
    assert (Category.INPUTS, 2176) not in d.grew(tolerance=2176)  # strictly more than the tolerance
    assert d.grew(rel=1.0) == [c for c in grown if c[1] > (mlp8.peak[c[0]])]
    assert d.shrank() == []


def test_diff_text_and_frames(mlp8, mlp16):
    d = diff(mlp8, mlp16, labels=("batch 8", "batch 16"))
    text = str(d)
    assert text.splitlines()[0] == "memprof diff: batch 8 -> batch 16 (breakdown at the peak)"
    inputs = next(line for line in text.splitlines() if line.strip().startswith("inputs"))
    assert inputs.split() == ["inputs", "2.1", "KiB", "4.2", "KiB", "+2.1", "KiB", "+100.0%", "grew"]
    weights = next(line for line in text.splitlines() if line.strip().startswith("weights"))
    assert weights.split()[-2:] == ["0.0%", "same"]
    assert re.search(r"allocator_overhead +not measured +not measured$", text, re.M)
    frame = d.to_frame()
    assert list(frame.columns) == ["a", "b", "delta", "delta_pct"]
    assert list(frame.index) == [c.value for c in Category] and frame.index.name == "category"
    assert str(frame["delta"].dtype) == "Int64" and str(frame["delta_pct"].dtype) == "Float64"
    assert frame.loc["inputs", "delta"] == 2176
    assert frame["delta"].isna().tolist() == [c in (Category.ALLOCATOR_OVERHEAD, Category.OUTSIDE_TORCH)
                                             for c in Category]
    pf = d.phases_frame()
    assert list(pf.columns) == ["step", "phase", "occurrence", "a", "b", "delta", "delta_pct"]
    assert len(pf) == len(d.phases)
    html = d._repr_html_()
    assert "batch 8" in html and "not measured" in html and "+100.0%" in html


def test_diff_with_itself_is_all_zero(mlp8):
    d = diff(mlp8, mlp8)
    assert all(c.delta in (0, None) for c in d.categories)
    assert [c.delta for c in d.categories if c.a is not None] == [0] * 9
    assert d.total.delta == 0 and d.total.delta_pct == 0.0
    assert all(p.delta == 0 for p in d.phases) and d.unchanged
    assert d.grew() == [] and d.shrank() == []
    assert "grew" not in str(d) and "shrank" not in str(d)


def test_diff_unmatched_phases_paths_and_notes(mlp8, light8, tmp_path):
    one_step = run_mlp(8, steps=1)
    d = diff(mlp8, one_step)
    keys_a = [(p.step, p.phase, p.occurrence) for p in mlp8.trace.phases]
    keys_b = [(p.step, p.phase, p.occurrence) for p in one_step.trace.phases]
    assert d.only_in_a == tuple(k for k in keys_a if k not in keys_b)
    assert d.only_in_b == tuple(k for k in keys_b if k not in keys_a)
    assert [p.key for p in d.phases] == [k for k in keys_a if k in keys_b]
    # Every phase of step 1 exists only in the two-step run.
    assert {k for k in keys_a if k[0] == 1} <= set(d.only_in_a)
    assert "Only in a: step 1 forward" in str(d)
    # Paths of saved traces and Traces work like Reports.
    path = tmp_path / "run.json"
    mlp8.save(path)
    assert diff(str(path), mlp8.trace).unchanged
    # Light against full: temporaries and totals were not measured in light mode on CPU.
    mixed = diff(light8, mlp8)
    assert mixed[Category.TEMPORARIES].delta is None and mixed.total.delta is None
    assert any("light mode" in n for n in mixed.notes)
    assert all(v is not None for _, v in mixed.grew())
    assert "not measured" in str(mixed)
    with pytest.raises(InvalidArgumentError):
        diff(mlp8, 3)
    with pytest.raises(InvalidArgumentError):
        diff(mlp8, mlp8, at="middle")
    with pytest.raises(InvalidArgumentError):
        d.grew(tolerance=-1)


def test_diff_shrank(mlp8, mlp16):
    d = diff(mlp16, mlp8)
    assert (Category.INPUTS, -2176) in d.shrank()
    assert "shrank" in str(d)
    assert d.grew() == []
