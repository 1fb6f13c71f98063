"""The plots (memprof.render.plot): timeline, modules and waterfall, on small runs profiled for real on CPU."""

from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")

import pytest

from memprof.errors import InvalidArgumentError, MemprofError, MissingExtraError, NotMeasuredError
from memprof.render.plot import plot_modules, plot_timeline, plot_waterfall
from memprof.vocabulary import Category

from runs import run_mlp


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
        plot_timeline(run_mlp(4, steps=1, timeline=False))
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
