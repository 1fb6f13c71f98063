"""Loading a trace file: anything that is not a trace memprof wrote is refused with a TraceFormatError
that names the fix, never a TypeError from deep inside, and never a report that crashes when printed."""

from __future__ import annotations

import json

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
