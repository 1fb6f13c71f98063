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


@pytest.mark.parametrize("field", ["weights", "total"])
@pytest.mark.parametrize("value, message", [
    (True, "must be an int, got True"), (1.0, "must be an int, got 1.0"), ("5", "must be an int, got '5'"),
    (-1, "must be between 0 and 2\\*\\*63 - 1, got -1"),
    (2**63, "must be between 0 and 2\\*\\*63 - 1, got 9223372036854775808")])
def test_a_breakdown_s_bad_count_is_refused_naming_its_field(tmp_path, field, value, message):
    # Breakdowns are read by a check in a few C calls; the one that fails is named as by the count-by-count check.
    data = _saved_trace(tmp_path)
    data["peak"][field] = value
    p = tmp_path / "t.json"
    p.write_text(json.dumps(data))
    with pytest.raises(TraceFormatError, match=f"{field} {message}"):
        memprof.load(p)


def test_load_refuses_foreign_json_shapes(tmp_path):
    p = tmp_path / "t.json"
    for raw in (b"", b"[1, 2]", b"null", b'"memprof.trace"', b"\xff\xfe\x00"):
        p.write_bytes(raw)
        with pytest.raises(TraceFormatError, match="report.save"):
            memprof.load(p)


def test_a_trace_is_built_with_the_count_of_its_steps():
    # Trace.num_steps is an int, never None to be filled in later: whoever builds a trace says how many steps ran
    # (the collector its count, the loader what a file says or, for schema 1 and 2 files, what it holds and names).
    t = full_trace()
    given = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name != "num_steps"}
    with pytest.raises(TypeError, match="num_steps"):
        Trace(**given)
    assert Trace(**given, num_steps=t.num_steps) == t


def test_a_file_that_does_not_say_how_many_steps_ran_counts_those_it_holds_and_names():
    # A schema 2 file wrote no num_steps: the loader counts them. This one holds step 0 in full, its peak and its
    # last sample are in step 0, and its forward statistics count 5 phases (one a step at most): max(1, 0, 0, 5).
    data = full_trace().to_dict()
    data["schema_version"] = 2
    del data["num_steps"]
    assert [s["index"] for s in data["steps"]] == [0] and data["peak_step"] == 0
    assert data["timeline"][-1]["step"] == 0 and [p["count"] for p in data["phase_stats"]] == [5]
    loaded = Trace.from_dict(data)
    assert loaded.num_steps == 5 and type(loaded.num_steps) is int
    # Without the statistics, the step held is all it has: one step ran.
    data["phase_stats"] = []
    assert Trace.from_dict(data).num_steps == 1


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


# --------------------------------- each list in its order, each cross-reference to something the trace holds
# (review of issue 36, loader item 3: what a file says in the wrong order, twice, or of something it does not hold)


def test_a_key_given_twice_in_one_object_is_refused(tmp_path):
    # JSON allows it and Python's reader keeps the last: "num_steps": 2, "num_steps": 7 would read as 7.
    text = json.dumps(full_trace().to_dict()).replace('"num_steps": 5', '"num_steps": 5, "num_steps": 7', 1)
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(TraceFormatError) as info:
        memprof.load(path)
    assert str(info.value) == (f"{path} gives the key 'num_steps' twice in one object, where a trace says each thing "
                               "once; give a file written by report.save()")
    nested = json.dumps(full_trace().to_dict()).replace('"weights": 144,', '"weights": 144, "weights": 0,', 1)
    path.write_text(nested)
    with pytest.raises(TraceFormatError, match="gives the key 'weights' twice in one object"):
        memprof.load(path)


def _timed(**changes):
    """timed_trace() as its file holds it: samples 0 (10 us) and 1 (45 us) of step 0, one step of two phases,
    the peak (432 B) in its backward."""
    data = timed_trace().to_dict()
    data.update(changes)
    return data


def _full():
    """full_trace() as its file holds it: step 0 kept of 5, forward, backward and optimizer, the peak (728 B)
    in the optimizer phase, modules "<model>" and "fc", one sample (1, step 0)."""
    return full_trace().to_dict()


def _sample(data, seq, step, **changes):
    return dict(data["timeline"][0], seq=seq, step=step, **changes)


def _cases():
    """(name, the file, the one error) for each rule."""
    cases = []

    def case(name, data, message):
        cases.append(pytest.param(data, message, id=name))

    d = _timed()
    d["timeline"].reverse()
    case("timeline reversed", d, "timeline sample 0 is listed after sample 1")
    d = _timed()
    d["timeline"].append(d["timeline"][-1])
    case("a sample twice", d, "timeline sample 1 is listed after sample 1")
    d = _full()
    d["timeline"] = [_sample(d, 1, 3), _sample(d, 2, 0)]
    case("a sample of an earlier step later", d, "timeline sample 2 (step 0) is listed after sample 1 of step 3")
    d = _timed()
    d["timeline"][1]["time_us"] = 5.0
    case("a sample earlier in time later", d, "timeline sample 1 (5.0 microseconds) is listed after sample 0 (10.0)")
    d = _timed()
    d["timeline"][1]["step"] = 99
    case("a sample of a step that did not run", d, "the timeline holds a sample of step 99 but the run had 1 steps")
    # The controls: a sample of the step in progress when the profile ended (step 1 of a run of one step; step 0
    # of an OOM dump written before any phase, which kept no step), which no record holds, loads.
    d = _timed()
    d["timeline"][1]["step"] = 1
    case("a sample of the step in progress at the end", d, None)
    d = _timed(steps=[], num_steps=0, peak_step=None, peak_phase=None, peak_module=None)
    d["peak"] = d["end"] = d["start"]
    case("a sample of the first step, which did not end", d, None)
    d = _timed()
    d["timeline"][0].update(event="phase", label="backward")
    case("a phase's sample of another phase", d,
         "timeline sample 0 marks the beginning of forward but is labelled 'backward'")
    d = _timed()
    d["steps"][0]["phases"][1]["occurrence"] = 3
    case("backward #3 alone", d, "step 0 holds backward #3 but no backward #0 (a step's phases of one kind are "
                                 "numbered 0, 1, 2 ...)")
    d = _full()
    d["steps"][0]["phases"] = []
    case("a step of no phase", d, "step 0 holds no phase")
    # The peak: 432 B, first reached in step 0's backward (forward peaks at 320 B).
    case("the peak's phase without its step", _timed(peak_step=None),
         "peak_step is None but peak_phase is backward: the peak's step and phase are given together")
    case("the peak in a phase of lower peak", _timed(peak_phase="forward"),
         "the peak (432 bytes of tensors) is said to be in step 0's forward, but step 0's backward phase reached it "
         "first")
    case("the peak in a phase the step does not hold", _timed(peak_phase="optimizer"),
         "the peak (432 bytes of tensors) is said to be in step 0's optimizer, which step 0 does not hold")
    d = _timed()
    d["peak"], d["end"] = d["steps"][0]["phases"][0]["peak"], d["steps"][0]["phases"][0]["end"]  # 320 B, 288 B
    d["peak_phase"] = "forward"
    case("a phase above the run's peak", d, "step 0's backward phase peaks at 432 bytes of tensors, above the run's "
                                            "peak (320)")
    d = _timed()
    d["peak"] = dict(d["peak"], temporaries=68, total=500)  # 432 + 68: a level no phase reached
    case("a peak no phase reached", d, "the peak (500 bytes of tensors) is said to be in step 0's backward, whose "
                                       "highest peak is 432 bytes")
    d = _full()
    d["steps"].append({"index": 2, "phases": [dict(p, step=2) for p in d["steps"][0]["phases"]]})
    d["peak_step"] = 2
    case("the peak in a later step than reached it", d,
         "the peak (728 bytes of tensors) is said to be in step 2's optimizer, but step 0's optimizer phase reached "
         "it first")
    # Modules: "<model>" and "fc".
    d = _full()
    d["modules"].append(dict(d["modules"][1], path="block.fc"))
    case("a module without its parent", d, "module 'block.fc' is listed but its parent 'block' is not in the "
                                           "module table")
    case("the peak in a module not listed", _timed(peak_module="gone"), "peak_module 'gone' is not in the module table")
    case("a module live at the error not listed", _full() | {"live_modules_at_error": [["gone", 8]]},
         "a module live at the error 'gone' is not in the module table")
    case("a live storage's module not listed", _full() | {"live_storages_at_error": [[4096, 8, "weights", "gone"]]},
         "a live storage's module 'gone' is not in the module table")
    case("a router call's module not listed", _full() | {"routing": {"calls": [["gone", 2, 1, [3, 1]]]}},
         "a router call's module 'gone' is not in the module table")
    # Steps run (5) and recorded: step 0 is kept.
    case("recorded stretches that overlap", _full() | {"schedule": "s", "recorded_steps": [[0, 2], [2, 3]]},
         "a stretch of recorded steps 2-3 begins before the one before it ended (2)")
    case("a kept step outside the recorded stretches", _full() | {"schedule": "s", "recorded_steps": [[1, 2]]},
         "step 0 is kept but no stretch of recorded steps holds it")
    case("recorded steps that did not run", _full() | {"schedule": "s", "recorded_steps": [[0, 6]]},
         "the recorded steps end at step 6 but the run had 5 steps")
    case("optimizer steps that did not run", _full() | {"optimizer_steps": [[0, 6, "measured"]]},
         "the optimizer steps end at step 6 but the run had 5 steps")
    d = _full()
    d["steps"][0]["phases"] = [dict(p, step=3) for p in d["steps"][0]["phases"]]
    d["steps"][0]["index"] = 3
    d.update(peak_step=3, num_steps=3, phase_stats=[])
    case("a kept step that did not run", d, "step 3 is recorded but the run had 3 steps")
    # Statistics: forward #0 counted in 5 phases.
    d = _full()
    d["phase_stats"][0]["count"] = 6
    case("statistics of more phases than steps", d,
         "the statistics of forward #0 count 6 phases, in a run of 5 steps (one a step at most, at least one)")
    d = _full()
    d["phase_stats"][0]["occurrence"] = 1
    case("statistics of forward #1 alone", d, "the statistics count 5 forward #1 phases but 0 forward #0")
    d = _full()
    d["phase_stats"].append(dict(d["phase_stats"][0], occurrence=1, count=4))
    d["phase_stats"][0]["count"] = 3
    case("statistics of more #1 than #0", d, "the statistics count 4 forward #1 phases but 3 forward #0")
    d = _full()
    d["operations"].append(dict(d["operations"][0], count=2))
    case("an operation twice", d, "an operation is listed twice: ('forward', 'Linear', 'aten.addmm')")
    # A generation's record: of step 0's phases (forward, backward, optimizer), each once.
    gen = {"tokens": [[0, "forward", 0, 7]], "moments": []}
    case("a generation's phase", _full() | {"generation": gen}, None)  # loads: the control
    case("a generation's phase twice", _full() | {"generation": gen | {"tokens": gen["tokens"] * 2}},
         "a phase's token count is listed twice: (0, 'forward', 0)")
    case("a generation's phase the step does not hold", _full() | {"generation": {"tokens": [[0, "decode", 0, 7]]}},
         "the generation record speaks of step 0's decode #0, which step 0 does not hold")
    case("a generation's phase of no kind", _full() | {"generation": {"tokens": [[0, "decoding", 0, 7]]}},
         "a token count's phase must be one of forward, backward, optimizer, other, prefill, decode, got 'decoding'")
    case("a generation's step that did not run", _full() | {"generation": {"tokens": [[7, "decode", 0, 7]]}},
         "the generation record speaks of step 7 but the run had 5 steps")
    # The control: the cache still held after the last step ended, in an "other" phase that joins the last step
    # (memprof writes its moment under the step in progress).
    held = [5, "other", 0, "end", 0, 0, 7, 1, False]
    case("a generation's cache held after the last step", _full() | {"generation": gen | {"moments": [held]}}, None)
    moment = [0, "forward", 0, "end", 0, 0, 7, None, False]
    case("a cache moment twice", _full() | {"generation": gen | {"moments": [moment, moment]}},
         "a cache moment is listed twice: (0, 'forward', 0, 'end')")
    return cases


@pytest.mark.parametrize("data, message", _cases())
def test_a_file_that_says_a_thing_twice_out_of_order_or_of_what_it_does_not_hold_is_refused(data, message):
    if message is None:
        Trace.from_dict(json.loads(json.dumps(data)))  # the control: the same file, consistent, loads
    else:
        _refused(data, message)


def test_light_mode_names_its_peak_by_the_ledger_it_has():
    # Light mode's ledger sees no temporaries: the phase it names need not hold the highest allocator figure.
    data = _timed(peak_phase="forward", mode="light")
    assert Trace.from_dict(json.loads(json.dumps(data))).peak_phase.value == "forward"
