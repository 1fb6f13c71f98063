"""The record on its own: Breakdown, a hand-built Trace's round trip through a file, the module tree,
the moments vocabulary. No model runs here."""

from __future__ import annotations

import json

import pytest

import memprof
from memprof import Category as C, Phase
from memprof.errors import InvalidArgumentError, TraceFormatError
from memprof.render.common import own_rows
from memprof.record.specs import TensorSpec
from memprof.record.trace import SCHEMA_VERSION, Breakdown, Trace, as_trace, parent_path
from memprof.vocabulary import PHASE_MOMENTS, RECONCILE_MOMENTS, parse_moment

from factories import bd, full_trace, module, trace


def test_a_category_not_given_is_not_measured_never_zero():
    b = bd(weights=400, activations=0)
    assert b[C.WEIGHTS] == 400 and b[C.ACTIVATIONS] == 0 and b[C.TEMPORARIES] is None
    assert b.total == 400
    assert b.measured() == {C.WEIGHTS: 400, C.ACTIVATIONS: 0}
    assert bd(None, weights=400).total is None
    assert Breakdown.empty().total is None and Breakdown.empty().measured() == {}


def test_a_breakdown_with_the_wrong_number_of_values_is_refused():
    with pytest.raises(TraceFormatError, match="needs 11 values"):
        Breakdown((1, 2, 3), 6)


def test_a_hand_built_trace_survives_save_and_load_unchanged(tmp_path):
    original = full_trace()
    path = tmp_path / "run.json"
    memprof.Report(original).save(path)
    loaded = memprof.load(path).trace
    assert loaded == original
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION == 7
    # The peak is the highest phase peak: 144 + 144 + 296 + 144 = 728 bytes in the optimizer step.
    assert (loaded.peak.total, loaded.peak_step, loaded.peak_phase) == (728, 0, Phase.OPTIMIZER)


def test_a_newer_schema_is_refused_with_the_fix(tmp_path):
    data = full_trace().to_dict()
    data["schema_version"] = 99
    with pytest.raises(TraceFormatError, match="upgrade torch-memprof"):
        Trace.from_dict(data)


def test_phases_are_the_steps_phases_in_order():
    t = full_trace()
    assert [(p.step, p.phase.value) for p in t.phases] == [(0, "forward"), (0, "backward"), (0, "optimizer")]
    assert t.peak_location() == ["step 0", "optimizer"]


def test_the_module_tree_shows_leaves_and_what_containers_hold_themselves():
    t = trace(modules=(
        module("<model>", "Net", activations=700, own=100),
        module("blocks", "ModuleList", activations=600, own=0),
        module("blocks.0", "Block", activations=300, own=100),
        module("blocks.0.fc", "Linear", activations=200),
        module("blocks.1", "Block", activations=300, own=300),
    ))
    rows = {r["path"]: r for r in own_rows(t, include_own=True)}
    # Leaves: blocks.0.fc (200) and blocks.1 (a Block with no recorded children: all 300 its own).
    assert rows["blocks.0.fc"]["activations"] == 200 and rows["blocks.1"]["activations"] == 300
    # blocks.0 holds 300 with 200 in its child fc: 100 of its own code's.
    own = {r["path"]: r["activations"] for r in own_rows(t, include_own=True) if r["own"]}
    assert own["blocks.0"] == 100
    assert "blocks.0" not in {r["path"] for r in own_rows(t, include_own=False)}


def test_parent_paths():
    assert [parent_path(p) for p in ("a.b.c", "a", "", "<model>")] == ["a.b", "", "", ""]


def test_moments_have_one_vocabulary():
    assert PHASE_MOMENTS == ("peak", "start", "end") and RECONCILE_MOMENTS == ("peak", "steady")
    assert parse_moment(" END ", PHASE_MOMENTS) == "end"
    with pytest.raises(InvalidArgumentError, match=r"at must be peak, start or end .*got 'steady'"):
        parse_moment("steady", PHASE_MOMENTS)


def test_a_report_or_a_trace_is_accepted_anything_else_named():
    t = full_trace()
    assert as_trace(t) is t and as_trace(memprof.Report(t)) is t
    with pytest.raises(InvalidArgumentError, match="expected a memprof Report or Trace, got dict"):
        as_trace({})


def test_tensor_specs_know_their_bytes():
    assert TensorSpec((3, 8), "bfloat16").nbytes == 3 * 8 * 2
    assert TensorSpec((), "float64").nbytes == 8
