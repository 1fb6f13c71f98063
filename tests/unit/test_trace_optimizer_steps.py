"""``Trace.optimizer_steps``: which steps' optimizer phases were measured and which carried, read strictly from a
file, absent (empty) in files written before it."""

from __future__ import annotations

import dataclasses

import pytest

from memprof.errors import TraceFormatError
from memprof.record.trace import OPTIMIZER_STEP_KINDS, Trace
from tests.factories import full_trace

SPANS = ((0, 1, "measured"), (2, 4, "carried"), (5, 5, "not measured"), (6, 9, "partly carried"))


def _with(spans):
    return dataclasses.replace(full_trace(), optimizer_steps=spans, num_steps=10)  # spans name steps 0-9


def test_the_spans_survive_a_round_trip():
    original = _with(SPANS)
    data = original.to_dict()
    assert data["optimizer_steps"] == [[0, 1, "measured"], [2, 4, "carried"], [5, 5, "not measured"],
                                       [6, 9, "partly carried"]]
    assert Trace.from_dict(data) == original
    assert Trace.from_dict(data).optimizer_steps == SPANS


def test_a_file_written_before_the_field_reads_as_no_spans():
    data = _with(SPANS).to_dict()
    del data["optimizer_steps"]
    data["schema_version"] = 6
    assert Trace.from_dict(data).optimizer_steps == ()


@pytest.mark.parametrize("spans, problem", [
    ([[0, 1, "guessed"]], "kind must be one of"),
    ([[3, 1, "measured"]], "ends"),
    ([[0, 2, "measured"], [2, 3, "carried"]], "recorded after"),
    ([[0, 1]], "entry of optimizer_steps"),
    ([[-1, 1, "measured"]], "recorded step"),
])
def test_a_corrupt_span_is_refused(spans, problem):
    data = _with(()).to_dict()
    data["optimizer_steps"] = spans
    with pytest.raises(TraceFormatError, match=problem):
        Trace.from_dict(data)


def test_every_kind_the_collector_writes_is_one_a_file_may_hold():
    from memprof.collect import carry

    assert set(OPTIMIZER_STEP_KINDS) == {carry.MEASURED, carry.CARRIED, carry.PARTLY, carry.UNVERIFIED,
                                         carry.NOT_MEASURED}
