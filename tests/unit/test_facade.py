"""The facade pairs results with renderers, and only the facade: each result is one record, whose views are
functions the facade registers on its class (memprof.record.views), and what prints is to_text()."""

from __future__ import annotations

import dataclasses

import pytest

import memprof
from memprof.analyse import compare, merge
from memprof.analyse.reconciler import reconciliation
from memprof.record.parts import RankInfo
from memprof.record.views import registered
from memprof.render.text import diff_text, merged_text
from memprof.simulate import estimate, planner

from factories import full_trace

VIEWS = ("__str__", "to_text")


@pytest.mark.parametrize("data, facade", [
    (compare.Diff, "Diff"), (merge.Merged, "Merged"), (reconciliation.Reconciliation, "Reconciliation"),
    (estimate.Estimate, "Estimate"), (planner.BatchSizePlan, "BatchSizePlan"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_each_result_is_one_class_whose_views_are_registered_from_above(data, facade):
    # No look-alike subclass: the public name is the record the floor below returns, and it prints through the
    # views the facade registered on it (memprof.record.views).
    assert getattr(memprof, facade) is data
    assert all(name in vars(data) for name in VIEWS) and data.__str__ is not object.__str__
    assert registered(data, "to_text")


def test_diff_returns_the_record_with_the_data_fields_and_prints_its_text():
    t = full_trace()
    d = memprof.diff(t, memprof.Report(t), labels=("before", "after"))
    assert isinstance(d, memprof.Diff) and isinstance(d, compare.Diff)
    plain = compare.diff(t, t, labels=("before", "after"))
    assert dataclasses.asdict(d) == dataclasses.asdict(plain)
    assert str(d) == d.to_text() == diff_text(plain)
    assert memprof.Report(t).diff(t, labels=("before", "after")).to_text() == str(d)


def test_merge_holds_traces_below_and_reports_in_the_facade():
    ranks = [dataclasses.replace(full_trace(), distributed=RankInfo(r, 2, "gloo", "ddp")) for r in (0, 1)]
    plain = merge.merge(ranks)
    assert all(isinstance(t, memprof.Trace) for t in plain.ranks.values())
    merged = memprof.merge(ranks)
    assert all(isinstance(r, memprof.Report) and r.trace is ranks[k] for k, r in merged.ranks.items())
    assert (merged.worst, merged.spread) == (plain.worst, plain.spread)
    assert str(merged) == merged_text(plain) == merged_text(merged)


def test_a_profiler_from_memprof_gives_a_report_the_collecting_profiler_has_none():
    from memprof.collect.profiler import Profiler as Collecting

    assert not hasattr(Collecting, "report") and issubclass(memprof.Profiler, Collecting)
    assert callable(memprof.Profiler.report)
