"""The matplotlib figures (memprof.render.plot) of hand-built traces, read back from their artists: which
categories are stacked and at what heights, the peak line, the axis units and what the title says was not
measured."""

from __future__ import annotations

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from memprof.errors import InvalidArgumentError  # noqa: E402
from memprof.render.plot import plot_modules, plot_timeline, plot_waterfall  # noqa: E402

from factories import module, timed_trace, trace  # noqa: E402


def test_the_timeline_stacks_each_measured_category_up_to_the_peak():
    fig = plot_timeline(timed_trace())
    ax = fig.axes[0]
    stacks = [c.get_gid() for c in ax.collections if (c.get_gid() or "").startswith("memprof-stack-")]
    # Every measured category but the cache and collectives, which a training run of one process never holds.
    assert stacks == [f"memprof-stack-{c}" for c in ("weights", "buffers", "gradients", "optimizer_states",
                                                      "activations", "inputs", "temporaries")]
    (peak,) = [line for line in ax.lines if line.get_gid() == "memprof-peak"]
    assert list(peak.get_ydata()) == [432, 432]  # bytes: the run is far below 1 KiB
    assert ax.get_ylabel() == "memory (B)"
    # The device rows are named as not measured; the cache and collectives, which such a run never holds, are
    # left out of the title as of the stack.
    assert ax.get_title(loc="left") == ("Memory timeline: 1 step, exact mode, cpu\n"
                                        "not measured: allocator_overhead, outside_torch")
    with pytest.raises(InvalidArgumentError):
        plot_timeline("not a trace")


def test_modules_are_ranked_by_saved_activations():
    t = trace(modules=(module("a", "Linear", parameters=4096, activations=1024),
                       module("b", "ReLU", activations=3072), module("c", "Linear", parameters=2048, activations=0)))
    ax = plot_modules(t).axes[0]
    # The largest at the top: b (3 KiB), a (1 KiB), c (0).
    assert [t.get_text() for t in ax.get_yticklabels()] == ["b (ReLU)", "a (Linear)", "c (Linear)"]
    bars = [p.get_width() for p in ax.patches if p.get_gid() == "memprof-modules-activations"]
    assert bars == [3.0, 1.0, 0.0] and ax.get_xlabel() == "memory (KiB)"


def test_a_waterfall_draws_each_step_and_what_is_left_unexplained():
    ax = plot_waterfall([("formula", 500), ("casts", 150), ("fused", -50), ("measured", 625)]).axes[0]
    # 500 + 150 - 50 = 600, so 25 B are left unexplained and drawn as their own bar; all below 1 KiB: bytes.
    assert ax.get_ylabel() == "memory (B)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["formula", "casts", "fused", "unexplained", "measured"]
    bars = {p.get_gid(): (p.get_y(), p.get_height()) for p in ax.patches
            if (p.get_gid() or "").startswith("memprof-waterfall")}
    assert bars == {"memprof-waterfall-start": (0, 500), "memprof-waterfall-up": (500, 150),
                    "memprof-waterfall-down": (600, 50), "memprof-waterfall-unexplained": (600, 25),
                    "memprof-waterfall-end": (0, 625)}
    assert {t.get_text() for t in ax.texts} == {"500 B", "+150 B", "-50 B", "+25 B", "625 B"}
