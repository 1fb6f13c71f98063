"""The DataFrames (memprof.render.frames) of a hand-built trace: columns, nullable dtypes, and every value,
"not measured" as <NA> and never 0."""

from __future__ import annotations

import pytest

pd = pytest.importorskip("pandas")

from memprof.render.frames import (  # noqa: E402
    breakdown_frame, modules_frame, operations_frame, phase_stats_frame, phases_frame)

from factories import full_trace  # noqa: E402

NA = pd.NA
CATEGORIES = ["weights", "buffers", "gradients", "optimizer_states", "activations", "inputs", "kv_cache",
              "communication", "temporaries", "allocator_overhead", "outside_torch"]


def _rows(df):
    return [[None if v is NA else v for v in row] for row in df.astype(object).itertuples(index=False)]


def test_the_phase_table_has_a_row_per_phase_and_a_column_per_category():
    df = phases_frame(full_trace())
    assert list(df.columns) == ["step", "phase", "occurrence", "start", "peak", "end", "ops"] + CATEGORIES
    assert str(df["peak"].dtype) == "Int64" and str(df["kv_cache"].dtype) == "Int64"
    # The categories at each phase's peak; the record leaves the cache, collectives and device rows unmeasured.
    assert _rows(df) == [
        [0, "forward", 0, 144, 288, 240, 3, 144, 0, 0, 0, 96, 0, None, None, 48, None, None],
        [0, "backward", 0, 240, 336, 288, 0, 144, 0, 144, 0, 48, 0, None, None, 0, None, None],
        [0, "optimizer", 0, 288, 728, 584, 0, 144, 0, 144, 296, 0, 0, None, None, 144, None, None]]


def test_the_breakdown_has_bytes_and_the_share_of_the_total():
    df = breakdown_frame(full_trace())
    assert df.index.name == "category" and list(df.index) == CATEGORIES and list(df.columns) == ["bytes", "share"]
    assert _rows(df) == [[144, 144 / 728], [0, 0.0], [144, 144 / 728], [296, 296 / 728], [0, 0.0], [0, 0.0],
                         [None, None], [None, None], [144, 144 / 728], [None, None], [None, None]]


def test_modules_operations_and_statistics():
    mods = modules_frame(full_trace())
    assert mods.index.name == "path" and list(mods.index) == ["<model>", "fc"]
    assert list(mods.columns) == ["type", "calls", "parameters", "gradients", "activations", "peak_forward",
                                  "temporaries_forward", "peak_backward", "temporaries_backward"]
    assert _rows(mods) == [["Net", 1, 144, 144, 96, None, None, None, None],
                           ["Linear", 1, 144, 144, 96, 288, 48, 432, 0]]
    ops = operations_frame(full_trace())
    # addmm of a 3x8 batch by an 8x4 weight: 2 * 3 * 8 * 4 = 192 FLOPs.
    assert _rows(ops) == [["forward", "Linear", "aten.addmm", 1, 192, 288, 48]]
    stats = phase_stats_frame(full_trace())
    assert list(stats.columns) == ["phase", "occurrence", "moment", "category", "count", "min", "median", "max",
                                   "median_exact"]
    assert len(stats) == 24  # one phase x (peak, end) x (11 categories and the total)
    row = stats[(stats["moment"] == "peak") & (stats["category"] == "activations")]
    assert _rows(row) == [["forward", 0, "peak", "activations", 5, 96, 96, 100, True]]
    assert stats["min"].isna().sum() == 23  # only the forward's activations at its peak were summarised
