"""HTML report, plots and diffs, on small runs profiled for real on CPU."""

from __future__ import annotations

import re
import sys

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from torch import nn

import memprof
from memprof.vocabulary import Category
from memprof import Diff, diff
from memprof.errors import InvalidArgumentError, MemprofError, NotMeasuredError
from memprof.render.html import frame_html, report_html
from memprof.errors import MissingExtraError
from memprof.render.common import CATEGORY_COLORS
from memprof.render.plot import plot_modules, plot_timeline, plot_waterfall

from models import MLP
from training import profile_training


class RootOps(nn.Module):
    """Saves a tensor in its own forward (the tanh output), so "<model>" has an own-ops row."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        # tanh saves its output t (the root's own activation); fc2 saves t * 2, another storage.
        return self.fc2(torch.tanh(self.fc1(x)) * 2)


def _run_mlp(batch: int, steps: int = 2, mode: str = "exact", timeline: bool = True) -> memprof.Report:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(batch, 32), torch.randint(0, 10, (batch,))) for _ in range(steps)]
    return profile_training(model, opt, lambda i: batches[i], steps=steps, mode=mode, timeline=timeline)


@pytest.fixture(scope="module")
def mlp8():
    return _run_mlp(8)


@pytest.fixture(scope="module")
def mlp16():
    return _run_mlp(16)


@pytest.fixture(scope="module")
def light8():
    return _run_mlp(8, mode="light")


@pytest.fixture(scope="module")
def root_ops():
    torch.manual_seed(0)
    model = RootOps()
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt) as prof:
        x = torch.randn(4, 16)
        model(x).square().mean().backward()
        opt.step()
    return prof.report()


# -- HTML ----------------------------------------------------------------------------------------


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


# -- plots ---------------------------------------------------------------------------------------


def _stacks(ax):
    return [c for c in ax.collections if (c.get_gid() or "").startswith("memprof-stack-")]


def test_plot_timeline_exact_mode(mlp8):
    from matplotlib.figure import Figure

    fig = plot_timeline(mlp8)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    # The tensor categories but the KV cache and collective buffers, which one process training never holds;
    # CPU has no allocator or driver rows.
    quiet = (Category.KV_CACHE, Category.COMMUNICATION)
    measured = [c for c in Category if any(s.breakdown[c] is not None for s in mlp8.trace.timeline)
                and c not in quiet]
    assert all(s.breakdown[c] == 0 for s in mlp8.trace.timeline for c in quiet)
    assert len(measured) == 7
    stacks = _stacks(ax)
    assert [s.get_gid() for s in stacks] == [f"memprof-stack-{c.value}" for c in measured]
    peak_lines = [ln for ln in ax.lines if ln.get_gid() == "memprof-peak"]
    assert len(peak_lines) == 1
    # Peak 58.2 KiB: the y axis is in KiB and the line sits at the peak total.
    assert ax.get_ylabel() == "memory (KiB)"
    assert peak_lines[0].get_ydata()[0] == pytest.approx(mlp8.peak.total / 1024)
    assert "not measured: allocator_overhead, outside_torch" in ax.get_title(loc="left")
    assert ax.get_xlabel() == "profiling events (module and phase boundaries)"
    assert ax.get_legend() is not None
    fig.canvas.draw()  # renders without error on Agg


def test_plot_timeline_light_mode_omits_unmeasured(light8):
    fig = plot_timeline(light8)
    ax = fig.axes[0]
    gids = [s.get_gid() for s in _stacks(ax)]
    assert "memprof-stack-temporaries" not in gids and len(gids) == 6
    assert not [ln for ln in ax.lines if ln.get_gid() == "memprof-peak"]
    title = ax.get_title(loc="left")
    assert "not measured: temporaries, allocator_overhead, outside_torch" in title
    assert "peak total not measured" in title


def test_plot_timeline_on_given_axes_and_without_timeline(mlp8):
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    assert plot_timeline(mlp8.trace, ax=ax) is fig
    with pytest.raises(NotMeasuredError, match="timeline=True"):
        plot_timeline(_run_mlp(4, steps=1, timeline=False))
    with pytest.raises(InvalidArgumentError):
        plot_timeline("not a report")


def test_plot_modules(mlp8, root_ops):
    fig = plot_modules(mlp8)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    # Leaves only for the MLP (its root runs no op of its own): act, fc2, fc1, fc3 by saved activations.
    assert labels == ["act (ReLU)", "fc2 (Linear)", "fc1 (Linear)", "fc3 (Linear)"]
    act_bars = [p for p in ax.patches if p.get_gid() == "memprof-modules-activations"]
    assert len(act_bars) == 4
    # ReLU runs twice in MLP.forward: 2 outputs of 8 x 64 float32 = 2 * 2048 bytes saved.
    assert act_bars[0].get_width() == pytest.approx(4096 / 1024)
    assert ax.get_xlabel() == "memory (KiB)"
    fig2 = plot_modules(root_ops, top=2)
    labels2 = [t.get_text() for t in fig2.axes[0].get_yticklabels()]
    assert len(labels2) == 2 and "<model> (RootOps, own ops)" in labels2
    with pytest.raises(InvalidArgumentError):
        plot_modules(mlp8, top=0)


def test_plot_waterfall():
    MiB = 2**20
    fig = plot_waterfall([("formula", 100 * MiB), ("casts", 12 * MiB), ("fused", -5 * MiB), ("measured", 110 * MiB)])
    ax = fig.axes[0]
    kinds = [p.get_gid() for p in ax.patches if (p.get_gid() or "").startswith("memprof-waterfall")]
    # 100 + 12 - 5 = 107, so 3 MiB are left unexplained and drawn as their own bar.
    assert sorted(kinds) == sorted(["memprof-waterfall-start", "memprof-waterfall-end", "memprof-waterfall-up",
                                    "memprof-waterfall-down", "memprof-waterfall-unexplained"])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["formula", "casts", "fused", "unexplained", "measured"]
    assert ax.get_ylabel() == "memory (MiB)"
    texts = {t.get_text() for t in ax.texts}
    assert {"100.0 MiB", "+12.0 MiB", "-5.0 MiB", "+3.0 MiB", "110.0 MiB"} <= texts
    down = next(p for p in ax.patches if p.get_gid() == "memprof-waterfall-down")
    assert (down.get_y(), down.get_height()) == (pytest.approx(107), pytest.approx(5))
    with pytest.raises(InvalidArgumentError):
        plot_waterfall([("only", 1)])
    with pytest.raises(InvalidArgumentError):
        plot_waterfall([("a", 1), ("b", "2")])


def test_missing_matplotlib_names_the_extra(monkeypatch, mlp8):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for call in (lambda: plot_timeline(mlp8), lambda: plot_modules(mlp8),
                 lambda: plot_waterfall([("a", 1), ("b", 2)])):
        with pytest.raises(MissingExtraError) as info:
            call()
        assert isinstance(info.value, MemprofError) and isinstance(info.value, ImportError)
        assert "pip install 'torch-memprof[plot]'" in str(info.value)


# -- diff ----------------------------------------------------------------------------------------


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
    one_step = _run_mlp(8, steps=1)
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
