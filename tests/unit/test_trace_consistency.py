"""The loader checks that a trace's parts agree, not only their types: a file memprof could not have
written is refused with a TraceFormatError naming what disagrees, so a report never shows a peak
smaller than its own parts, a note split into letters or a rank outside its world."""

from __future__ import annotations

import copy
import json

import pytest

import memprof
from memprof.cli import main
from memprof.errors import TraceFormatError
from memprof.record.trace import Trace

from factories import full_trace


@pytest.fixture
def data():
    """full_trace() as its file holds it: one forward, backward and optimizer phase of Linear(8, 4)."""
    return full_trace().to_dict()


def _refused(data, match):
    with pytest.raises(TraceFormatError, match=match):
        Trace.from_dict(data)


def _set(data, where, value):
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    return data


# -- breakdowns: the categories and the total agree ---------------------------------------------------


def test_parts_that_exceed_their_total_are_refused(data):
    # Every tensor category measured: 288 B of weights cannot be a total of 5 B (the report would say
    # "Peak 5 B" with weights at 5,760 %).
    peak = {"weights": 288, "buffers": 0, "gradients": 0, "optimizer_states": 0, "activations": 0, "inputs": 0,
            "kv_cache": 0, "communication": 0, "temporaries": 0, "total": 5}
    _refused(_set(data, ("peak",), peak), "categories sum to 288 bytes but its total is 5")


def test_a_complete_breakdown_must_sum_to_its_total_exactly(data):
    # The optimizer phase's end with every tensor category measured, as a CPU run in exact mode has it
    # (the KV cache and collective buffers 0): 144 + 144 + 296 = 584 B; a total of 585 is one byte no
    # category holds.
    end = data["steps"][0]["phases"][2]["end"]
    end.update(kv_cache=0, communication=0)
    assert Trace.from_dict(copy.deepcopy(data)).phases[2].end.total == 584
    _refused(_set(data, ("steps", 0, "phases", 2, "end", "total"), 585), "sum to 584 bytes but its total is 585")


def test_with_a_category_not_measured_the_known_parts_stay_within_the_total(data):
    # Temporaries not measured: the other parts (144 + 144 + 296 = 584 B) may be below the total
    # (728 B, the rest being the unmeasured temporaries) but never above it.
    _set(data, ("peak", "temporaries"), None)
    assert Trace.from_dict(copy.deepcopy(data)).peak.total == 728
    _refused(_set(data, ("peak", "total"), 583), "sum to 584 bytes but its total is 583")


def test_a_timeline_sample_and_an_error_breakdown_are_checked_too(data):
    _refused(_set(copy.deepcopy(data), ("timeline", 0, "breakdown", "total"), 1), "total is 1")
    # 144 + 0 + 10 = 154 B live at the error, said to be 100.
    live = {"weights": 144, "temporaries": 10, "total": 100}
    _refused(_set(data, ("live_at_error",), live), "sum to 154 bytes but its total is 100")


# -- peaks are the highest moments --------------------------------------------------------------------


def test_a_phase_peak_below_its_start_or_end_is_refused(data):
    # The forward phase starts at 144 B (the weights); a peak of 100 B cannot be its highest moment.
    _set(data, ("steps", 0, "phases", 0, "peak"), {"weights": 100, "total": 100})
    _refused(data, "step 0's forward phase peaks at 100 bytes, below its own start or end \\(240\\)")


def test_the_runs_peak_below_its_start_or_end_is_refused(data):
    # The run ends holding 584 B (weights, gradients and AdamW state); its peak cannot be 500.
    _set(data, ("peak",), {"weights": 500, "total": 500})
    _refused(data, "the run's peak \\(500 bytes\\) is below its start or end \\(584\\)")


# -- steps, phases, ranks ------------------------------------------------------------------------------


def test_steps_and_their_phases_must_agree(data):
    _refused(_set(copy.deepcopy(data), ("steps", 0, "phases", 1, "step"), 3), "step 0 holds a phase of step 3")
    _refused(_set(copy.deepcopy(data), ("steps", 0, "phases", 1, "phase"), "forward"), "holds forward #0 twice")
    twice = copy.deepcopy(data)
    twice["steps"].append(copy.deepcopy(twice["steps"][0]))
    _refused(twice, "step 0 is recorded after step 0")
    # The file says five steps ran (0 to 4): a kept step 7 did not.
    moved = copy.deepcopy(data)
    moved["steps"][0]["index"] = 7
    for p in moved["steps"][0]["phases"]:
        p["step"] = 7
    moved["peak_step"] = 7
    _refused(moved, "step 7 is recorded but the run had 5 steps")
    _refused(_set(data, ("recorded_steps",), [[4, 2]]), "ends \\(2\\) before it starts \\(4\\)")


@pytest.mark.parametrize("rank, world, match", [
    (0, 2**40, "world size must be between 1 and 1,048,576 ranks"),
    (0, 0, "world size must be between 1"),
    (4, 4, "rank 4 does not exist in a world of 4"),
])
def test_ranks_must_exist_in_a_world_of_bounded_size(data, rank, world, match):
    _refused(_set(data, ("distributed",), {"rank": rank, "world_size": world}), match)


def test_a_merge_of_the_largest_world_stays_small(data, tmp_path):
    # One rank of the largest world a record may name: merge lists the 2**20 - 1 ranks not given as a
    # range, in one short line (a world of 10**7 once printed 88 MB).
    _set(data, ("distributed",), {"rank": 0, "world_size": 2**20})
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps(data))
    merged = memprof.merge([path])
    assert len(merged.missing) == 2**20 - 1
    assert merged.notes[0] == "ranks 1-1048575 of 1048576 were not given"
    assert len(str(merged)) < 1000


# -- lists are lists, strings are strings, flags are flags ---------------------------------------------


@pytest.mark.parametrize("where, value, match", [
    (("notes",), "abc", "notes must be a list, got 'abc'"),
    (("peak_tags",), [["saved_outside_modules", 12, 3]], "an entry of peak_tags must be a list of 2 values"),
    (("param_dtypes",), "float32", "param_dtypes must be a list"),
    (("steps",), "0", "steps must be a list"),
    (("steps", 0, "phases"), "fbo", "a step's phases must be a list"),
    (("peak_tags",), ["ab"], "an entry of peak_tags must be a list, got 'ab'"),
    (("live_modules_at_error",), ["f1"], "an entry of live_modules_at_error must be a list, got 'f1'"),
    (("module_calls", 0, "params"), ["wT"], "a parameter must be a list, got 'wT'"),
    (("module_calls", 0, "classes"), "Linear", "a module call's classes must be a list"),
    (("module_calls", 0, "grad"), "no", "a module call's grad must be true or false, got 'no'"),
    (("optimizers", 0, "params", 0, "requires_grad"), 1, "requires_grad must be true or false"),
    (("facts", "dims"), ["fc"], "a dimension must be a list, got 'fc'"),
    (("phase_stats", 0, "median_exact"), "yes", "median_exact must be true or false"),
])
def test_a_value_of_the_wrong_shape_is_refused(data, where, value, match):
    _refused(_set(data, where, value), match)


def test_a_lone_surrogate_is_replaced_and_the_report_prints(data, tmp_path, capsys):
    # "\ud800" is valid JSON but no encoding can write it: printing or saving it would raise.
    _set(data, ("notes",), ["before \ud800 after"])
    _set(data, ("modules", 1, "path"), "fc\udfff")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))  # ensure_ascii: the file holds the escape, as report.save writes it
    report = memprof.load(path)
    assert report.trace.notes == ("before \ufffd after",) and report.trace.modules[1].path == "fc\ufffd"
    assert main(["report", str(path), "--html", str(tmp_path / "t.html")]) == 0
    assert "before \ufffd after" in capsys.readouterr().out
    assert "before \ufffd after" in (tmp_path / "t.html").read_text(encoding="utf-8")


def test_the_shipped_files_still_load(data):
    assert Trace.from_dict(data) == full_trace()


@pytest.mark.parametrize("where, value, match", [
    # Every optional figure of a module, a device and the facts is checked, not only the required ones.
    (("modules", 1, "gradients"), "lots", "ModuleRecord.gradients must be an int"),
    (("device", "total_memory"), -1, "DeviceInfo.total_memory must be between 0"),
    (("facts", "batch_size"), [3], "ModelFacts.batch_size must be an int"),
    # A count is an int64, as torch's sizes and the frames' Int64 columns are.
    (("peak", "weights"), 2**63, "weights must be between 0 and 2\\*\\*63 - 1"),
    # Shapes and dtypes are ones torch can make a tensor of: the formulas do.
    (("module_calls", 0, "output", 1), "float33", "'float33' is not a dtype torch knows"),
    (("optimizers", 0, "params", 0, "dtype"), "Tensor", "'Tensor' is not a dtype torch knows"),
    (("optimizers", 0, "params", 0, "shape"), [2**40, 2**40], "larger than torch can hold"),
    # An optional part is absent or null, never a 0, "" or [] taken for "none".
    (("generation",), 0, "the generation record must be a mapping, got 0"),
    (("peak_phase",), "", "peak_phase must be one of forward, backward"),
    (("live_at_error",), [], "a breakdown must be a mapping"),
    # Names are exactly as memprof writes them.
    (("steps", 0, "phases", 0, "phase"), "Forward", "a phase must be one of forward"),
    (("timeline", 0, "phase"), "forward ", "a sample's phase must be one of"),
])
def test_a_value_the_loader_once_let_through_is_refused(data, where, value, match):
    _refused(_set(data, where, value), match)


def test_strings_in_settings_are_read_as_every_string_is(data):
    _set(data, ("module_calls", 0, "config", 0), ["mode", "a\ud800"])
    assert dict(Trace.from_dict(data).module_calls[0].config)["mode"] == "a\ufffd"


def test_a_file_that_does_not_say_how_many_steps_ran_counts_up_to_its_last_step(data, tmp_path):
    # Files before schema 3 kept every step and did not say how many ran. One whose only step is step 1 (step 0
    # left out by hand) ran at least 2 steps: the count is taken so, and the file saved again (which states it)
    # loads again. Counted as len(steps), 1, the saved file said "step 1 is recorded but the run had 1 steps".
    data = _set(data, ("steps", 0, "index"), 1)
    for phase in data["steps"][0]["phases"]:
        phase["step"] = 1
    data.pop("num_steps", None)
    data["schema_version"] = 1
    stats = data.pop("phase_stats")  # schema 3, as the count is: a file of schema 1 has none
    trace = Trace.from_dict(copy.deepcopy(data))
    assert trace.num_steps == 2
    report = memprof.Report(trace)
    report.save(tmp_path / "again.json")
    assert memprof.load(tmp_path / "again.json").trace.num_steps == 2
    # Statistics that count forward phases in 5 steps, a timeline sample of step 3: the count is the most any part
    # names (each step has one forward #0 at most), and the file saved again loads again.
    data.update(phase_stats=stats, schema_version=3)
    data["timeline"][0]["step"] = 3
    trace = Trace.from_dict(copy.deepcopy(data))
    assert trace.num_steps == 5
    memprof.Report(trace).save(tmp_path / "again.json")
    assert memprof.load(tmp_path / "again.json").trace.num_steps == 5
    data["phase_stats"] = []
    assert Trace.from_dict(copy.deepcopy(data)).num_steps == 3  # a sample of step 3: the step in progress at most
