"""Loading a trace file: anything that is not a trace memprof wrote is refused with a TraceFormatError
that names the fix, never a TypeError from deep inside, and never a report that crashes when printed."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

import memprof
from memprof.errors import TraceFormatError
from memprof.record.trace import StepRecord, Trace

from factories import full_trace, timed_trace


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


# ------------------------------------------------------------------ what is listed twice, what ends before it starts


def _refused(data, message):
    with pytest.raises(TraceFormatError) as info:
        Trace.from_dict(json.loads(json.dumps(data)))
    assert str(info.value) == f"corrupt memprof trace: {message}; re-create it with report.save(path)"


def test_a_module_listed_twice_is_refused():
    data = full_trace().to_dict()
    data["modules"].append(dict(data["modules"][1], activations=0))  # "fc" again, with other figures
    _refused(data, "a module is listed twice: 'fc'")


def test_every_list_keyed_by_a_name_refuses_it_twice():
    cases = []
    data = dataclasses.replace(full_trace(), live_modules_at_error=(("fc", 48), ("<model>", 96))).to_dict()
    data["live_modules_at_error"].append(["fc", 12])
    cases.append((data, "a module live at the error is listed twice: 'fc'"))
    data = full_trace().to_dict()
    data["phase_stats"].append(data["phase_stats"][0])
    cases.append((data, "a phase's statistics is listed twice: 'forward #0'"))
    data = full_trace().to_dict()
    data["peak_tags"].append(["saved_outside_modules", 1])
    cases.append((data, "a name in peak_tags is listed twice: 'saved_outside_modules'"))
    data = full_trace().to_dict()
    data["steps"][0]["phases"][0]["tags_end"].append(["saved_outside_modules", 1])
    cases.append((data, "a name in tags is listed twice: 'saved_outside_modules'"))
    for data, message in cases:
        _refused(data, message)


@pytest.mark.parametrize("which,times,message", [
    # forward runs 0-50 us (peak 40), backward 50-100 us (peak 70): each changed alone.
    (0, (50.0, 50.0, 10.0), "step 0's forward phase ends (10.0 microseconds) before it starts (50.0)"),
    (0, (0.0, 60.0, 50.0), "step 0's forward phase peaks at 60.0 microseconds, outside its start (0.0) and end (50.0)"),
    (1, (60.0, 40.0, 100.0), "step 0's backward phase peaks at 40.0 microseconds, outside its start (60.0) and end "
                             "(100.0)"),
    (1, (45.0, 70.0, 100.0), "step 0's backward phase starts (45.0 microseconds) before the phases recorded before "
                             "it ended (50.0)"),
])
def test_a_phase_that_ends_before_it_starts_or_overlaps_the_one_before_is_refused(which, times, message):
    data = timed_trace().to_dict()
    p = data["steps"][0]["phases"][which]
    p["start_us"], p["peak_us"], p["end_us"] = times
    _refused(data, message)


def test_a_later_steps_phases_come_after_the_earlier_steps():
    t = timed_trace()

    def with_step_3_at(offset):
        later = tuple(dataclasses.replace(p, step=3, start_us=p.start_us + offset, peak_us=p.peak_us + offset,
                                          end_us=p.end_us + offset) for p in t.steps[0].phases)
        return dataclasses.replace(t, steps=t.steps + (StepRecord(3, later),), num_steps=4)

    # Step 0 ends at 100 us: a step 3 from 200 us loads; one from 90 us began before it ended.
    assert Trace.from_dict(json.loads(json.dumps(with_step_3_at(200).to_dict()))) == with_step_3_at(200)
    _refused(with_step_3_at(90).to_dict(), "step 3's forward phase starts (90.0 microseconds) before the phases "
                                           "recorded before it ended (100.0)")


def test_the_times_memprof_writes_load():
    t = timed_trace()
    assert Trace.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    # Files older than schema 4 have no times: nothing to order.
    untimed = dataclasses.replace(t, steps=tuple(StepRecord(s.index, tuple(
        dataclasses.replace(p, start_us=None, peak_us=None, end_us=None) for p in s.phases)) for s in t.steps))
    assert Trace.from_dict(json.loads(json.dumps(untimed.to_dict()))) == untimed
