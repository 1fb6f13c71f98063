"""Per-phase statistics (memprof.record.stats, gathered by memprof.collect.retention): one summary per (phase,
occurrence) over every step, with the exact count, min, median and max of each category at the phase's peak
and end, and the figures a run did not measure left as not measured."""

from __future__ import annotations

import pytest

from memprof import Category, Phase
from memprof.collect.retention import Retention
from memprof.errors import TraceFormatError
from memprof.record.stats import PhaseStats, Stat
from memprof.record.trace import StepRecord

from factories import bd, cpu, phase


def test_phase_stats_of_two_kinds_of_phase_are_kept_apart():
    r = Retention()
    for i in range(4):
        rec = StepRecord(i, (
            phase(i, "forward", start=cpu(), peak=cpu(activations=100), end=cpu(activations=50)),
            phase(i, "forward", occurrence=1, start=cpu(), peak=cpu(activations=300), end=cpu()),
        ))
        r.add(rec, peak_step=0)
    stats = {(s.phase, s.occurrence): s for s in r.phase_stats()}
    assert stats[(Phase.FORWARD, 0)].at("end", "activations") == (50, 50, 50)
    assert stats[(Phase.FORWARD, 1)].at("peak", "activations") == (300, 300, 300)


def _retained(activations, *, light_at=None):
    """One step per value: a forward saving ``a`` bytes, then an optimizer step with ``a`` bytes of
    temporaries, phases given optimizer first to show the statistics come in phase order. Step
    ``light_at`` measures no temporaries (and so no total)."""
    r = Retention()
    for i, a in enumerate(activations):
        def bd_(i=i, **kw):  # bound now: each step's breakdowns are built inside its own iteration
            if i != light_at:
                return cpu(**kw)
            return bd(None, **{"weights": 0, "buffers": 0, "gradients": 0, "optimizer_states": 0, "activations": 0,
                               "inputs": 0, **{k: v for k, v in kw.items() if k != "temporaries"}})
        r.add(StepRecord(i, (
            phase(i, "optimizer", start=bd_(weights=1000), peak=bd_(weights=1000, optimizer_states=2000, temporaries=a),
                  end=bd_(weights=1000, optimizer_states=2000)),
            phase(i, "forward", start=bd_(weights=1000), peak=bd_(weights=1000, activations=a, temporaries=10),
                  end=bd_(weights=1000, activations=a)),
        )), peak_step=0)
    return r.phase_stats()


def test_each_phase_has_the_count_min_median_and_max_of_every_figure():
    fwd, opt = _retained([300, 100, 200, 400])
    assert (fwd.phase, fwd.occurrence, fwd.count, fwd.median_exact) == (Phase.FORWARD, 0, 4, True)
    assert (opt.phase, opt.count) == (Phase.OPTIMIZER, 4)
    # Sorted 100 200 300 400: the lower median is 200.
    assert fwd.at("peak", Category.ACTIVATIONS) == Stat(100, 200, 400)
    assert fwd.at("end", "activations") == Stat(100, 200, 400)
    assert fwd.at("peak", "temporaries") == Stat(10, 10, 10)
    assert fwd.at("end", "temporaries") == Stat(0, 0, 0)
    # Totals: 1000 + a + 10 at the peak, 1000 + a at the end.
    assert fwd.at("peak", "total") == Stat(1110, 1210, 1410)
    assert fwd.at("end", "total") == Stat(1100, 1200, 1400)
    # The optimizer's peak: 1000 + 2000 + a; its end 3000 whatever a was.
    assert opt.at("peak", "total") == Stat(3100, 3200, 3400) and opt.at("end", "total") == Stat(3000, 3000, 3000)
    # What the run never measured stays not measured: the device rows, and the categories the record left out.
    assert [k for k, v in fwd.peak if v is None] == ["kv_cache", "communication", "allocator_overhead",
                                                    "outside_torch"]


def test_one_phase_that_did_not_measure_a_figure_makes_it_not_measured():
    fwd, opt = _retained([300, 100, 200, 400], light_at=2)
    assert fwd.at("peak", "temporaries") is None and fwd.at("peak", "total") is None
    assert opt.at("peak", "temporaries") is None and opt.at("end", "total") is None
    # The figures every step measured keep their statistics, step 2 included: activations 100 .. 400.
    assert fwd.at("peak", "activations") == Stat(100, 200, 400)


def test_a_statistic_round_trips_through_its_file_form_and_a_disordered_one_is_refused():
    fwd, _ = _retained([300, 100, 200, 400])
    data = fwd.to_dict()
    assert data["peak"]["activations"] == [100, 200, 400] and data["peak"]["kv_cache"] is None
    assert (data["phase"], data["occurrence"], data["count"], data["median_exact"]) == ("forward", 0, 4, True)
    assert PhaseStats.from_dict(data) == fwd
    for bad, message in (([3, 1, 2], "the statistic of weights must be ordered [min, median, max]"),
                         ([1, 2], "the statistic of weights must be [min, median, max]")):
        with pytest.raises(TraceFormatError) as info:
            PhaseStats.from_dict({**data, "peak": {"weights": bad}})
        assert str(info.value) == f"corrupt memprof trace: {message}; re-create it with report.save(path)"
