"""The Chrome/Perfetto trace (memprof.render.chrome) of a hand-built timed step, event by event: the tracks,
each counter written where its value changes, the phase and step spans, the peaks, the module span."""

from __future__ import annotations

from memprof.render.chrome import chrome_trace

from factories import full_trace, timed_trace


def _meta(tid, name, args):
    return {"ph": "M", "pid": 1, "tid": tid, "name": name, "args": args}


def _counter(name, ts, value):
    return {"ph": "C", "pid": 1, "name": name, "ts": ts, "args": {"bytes": value}}


def test_a_timed_step_is_every_event_the_viewers_read():
    doc = chrome_trace(timed_trace())
    fwd_peak = {"weights": 144, "buffers": 0, "gradients": 0, "optimizer_states": 0, "activations": 48, "inputs": 96,
                "temporaries": 32, "total": 320,
                "readable": "weights 144 B, activations 48 B, inputs 96 B, temporaries 32 B"}
    bwd_peak = {"weights": 144, "buffers": 0, "gradients": 144, "optimizer_states": 0, "activations": 48, "inputs": 96,
                "temporaries": 0, "total": 432,
                "readable": "weights 144 B, gradients 144 B, activations 48 B, inputs 96 B"}
    assert doc["traceEvents"] == [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "memprof: cpu (exact mode)"}},
        _meta(1, "thread_name", {"name": "steps"}), _meta(2, "thread_name", {"name": "phases"}),
        _meta(3, "thread_name", {"name": "modules (forward)"}),
        _meta(5, "thread_name", {"name": "modules (overlapping)"}),
        _meta(1, "thread_sort_index", {"sort_index": 1}), _meta(2, "thread_sort_index", {"sort_index": 2}),
        _meta(3, "thread_sort_index", {"sort_index": 3}), _meta(5, "thread_sort_index", {"sort_index": 5}),
        # At 0 us every measured category and the total (144 + 96 = 240 B); then only what changes.
        _counter("weights", 0.0, 144), _counter("buffers", 0.0, 0), _counter("gradients", 0.0, 0),
        _counter("optimizer_states", 0.0, 0), _counter("activations", 0.0, 0), _counter("inputs", 0.0, 96),
        _counter("temporaries", 0.0, 0), _counter("total", 0.0, 240),
        _counter("activations", 40.0, 48), _counter("temporaries", 40.0, 32), _counter("total", 40.0, 320),
        # fc's exit at 45 us: the temporaries are gone, 320 - 32 = 288 B.
        _counter("temporaries", 45.0, 0), _counter("total", 45.0, 288),
        _counter("gradients", 70.0, 144), _counter("total", 70.0, 432),
        # The backward's end: activations freed, 432 - 48 = 384 B.
        _counter("activations", 100.0, 0), _counter("total", 100.0, 384),
        {"ph": "X", "pid": 1, "tid": 2, "ts": 0.0, "dur": 50.0, "name": "forward",
         "args": {"step": 0, "start": 240, "peak": 320, "end": 288, "ops": 2}},
        {"ph": "i", "s": "t", "pid": 1, "tid": 2, "ts": 40.0, "name": "peak of forward (step 0)", "args": fwd_peak},
        {"ph": "X", "pid": 1, "tid": 2, "ts": 50.0, "dur": 50.0, "name": "backward",
         "args": {"step": 0, "start": 288, "peak": 432, "end": 384, "ops": 3}},
        {"ph": "i", "s": "t", "pid": 1, "tid": 2, "ts": 70.0, "name": "peak of backward (step 0)", "args": bwd_peak},
        {"ph": "i", "s": "g", "pid": 1, "tid": 2, "ts": 70.0, "name": "peak of the run", "args": {**bwd_peak,
                                                                                               "module": "fc"}},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 100.0, "name": "step 0", "args": {"step": 0}},
        {"ph": "X", "pid": 1, "tid": 3, "ts": 10.0, "dur": 35.0, "name": "fc", "args": {"step": 0, "phase": "forward"}},
    ]
    assert doc["displayTimeUnit"] == "ms"
    assert doc["otherData"] == {
        "memprof_version": "0.0.0", "torch_version": "2.13.0", "mode": "exact", "device": "cpu", "steps": 1,
        "steps_kept": [0], "not_measured": ["kv_cache", "communication", "allocator_overhead", "outside_torch"],
        "time_axis": "microseconds since the profile started", "notes": []}


def test_a_trace_without_a_clock_draws_each_phase_one_millisecond_long():
    doc = chrome_trace(full_trace())
    phases = [(e["name"], e["ts"], e["dur"]) for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == 2]
    # Phase i spans i * 1000 us to i * 1000 + 999 us.
    assert phases == [("forward", 0.0, 999.0), ("backward", 1000.0, 999.0), ("optimizer", 2000.0, 999.0)]
    # The run's peak is the optimizer's, at the middle of its millisecond: 144 + 144 + 296 + 144 = 728 B.
    (top,) = [e for e in doc["traceEvents"] if e["name"] == "peak of the run"]
    assert (top["ts"], top["args"]["total"]) == (2500.0, 728)
    assert doc["otherData"]["time_axis"].startswith("no clock in this trace")
    assert doc["otherData"]["steps"] == 5 and doc["otherData"]["steps_kept"] == [0]
    assert doc["otherData"]["notes"] == ["a note with \u00e9 and a newline\nin it"]
