"""Loading a trace file: anything that is not a trace memprof wrote is refused with a TraceFormatError
that names the fix, never a TypeError from deep inside, and never a report that crashes when printed."""

from __future__ import annotations

import json
import pathlib

import pytest

import memprof
from memprof.errors import TraceFormatError

from factories import full_trace


def _saved_trace(tmp_path):
    return full_trace().to_dict()


@pytest.mark.parametrize("key,value", [
    ("steps", 5), ("steps", [5]), ("modules", [{}]), ("device", "cpu"), ("peak_phase", "fwd"),
    ("timeline", None), ("notes", 5), ("live_modules_at_error", [[1]]),
])
def test_load_refuses_corrupt_fields(tmp_path, key, value):
    data = _saved_trace(tmp_path)
    data[key] = value
    p = tmp_path / "t.json"
    p.write_text(json.dumps(data))
    with pytest.raises(TraceFormatError, match="re-create it with report.save"):
        memprof.load(p)


@pytest.mark.parametrize("value", [[], None, 5])
def test_load_refuses_corrupt_breakdown(tmp_path, value):
    data = _saved_trace(tmp_path)
    data["start"] = value
    p = tmp_path / "t.json"
    p.write_text(json.dumps(data))
    with pytest.raises(TraceFormatError):
        memprof.load(p)


def test_load_refuses_non_integer_bytes(tmp_path):
    data = _saved_trace(tmp_path)
    data["peak"]["weights"] = "lots"
    p = tmp_path / "t.json"
    p.write_text(json.dumps(data))
    with pytest.raises(TraceFormatError):
        rep = memprof.load(p)
        str(rep)  # if load accepted it, rendering must not crash with a TypeError either


def test_load_refuses_foreign_json_shapes(tmp_path):
    p = tmp_path / "t.json"
    for raw in (b"", b"[1, 2]", b"null", b'"memprof.trace"', b"\xff\xfe\x00"):
        p.write_bytes(raw)
        with pytest.raises(TraceFormatError, match="report.save"):
            memprof.load(p)


def test_a_schema_1_file_written_by_memprof_0_1_still_loads_and_reconciles():
    # Written by the previous version (schema 1: formula results stored in the facts) for
    # Linear(16, 32) + ReLU + Linear(32, 4), 676 fp32 parameters, AdamW, two steps.
    path = pathlib.Path(__file__).parents[1] / "data" / "trace-schema1.json"
    rep = memprof.load(path)
    assert rep.trace.schema_version == 1 and rep.num_steps == 2
    assert rep.trace.mode == "exact"  # written as "full", the mode's former name
    rec = rep.reconcile(at="steady")
    formula = {r.category.value: r.formula for r in rec.rows}
    # weights and gradients: 676 x 4 B = 2,704; AdamW state: 2 x 2,704 + four 4-byte step counters = 5,424
    assert (formula["weights"], formula["gradients"], formula["optimizer_states"]) == (2704, 2704, 5424)
    assert all(rec.unexplained(c) in (0, None) for c in memprof.Category)
    assert "no formula" in str(rec) and "n/a" not in str(rec)


@pytest.mark.parametrize("written", ["full", "exact"])
def test_a_file_of_the_current_schema_loads_either_name_of_exact_mode(tmp_path, written):
    # Files written before the mode was renamed say "full"; both load as exact mode, and save as "exact".
    data = full_trace().to_dict()
    data["mode"] = written
    p = tmp_path / "t.json"
    p.write_text(json.dumps(data))
    trace = memprof.load(p).trace
    assert trace.mode == "exact" and trace.to_dict()["mode"] == "exact"
