"""check_budget (memprof.analyse.budget) on hand-built traces: what passes, what fails by one byte, which
breakdown ``at=`` judges, and every refusal, with the whole message a user reads."""

from __future__ import annotations

import textwrap

import pytest

from memprof import Category
from memprof.analyse.budget import BudgetResult, Judged, check_budget, compare_to_baseline, describe_growth
from memprof.errors import (BudgetNotMeasured, InvalidArgumentError, MemoryBudgetExceeded, MemoryGrewError,
                            MemprofError, SizeParseError, UnknownNameError)
from memprof.report.reports import Report

from factories import bd, cpu, phase, trace


def _run(**extra):
    """One step: 4 KiB of weights, a 512-byte batch, 8 KiB of AdamW state (two fp32 copies of the weights).

    The run's peak is the optimizer's: 4096 weights + 4096 gradients + 8192 state + 512 inputs + 4096
    temporaries = 20,992 B (20.5 KiB). It ends with the temporaries gone: 20,992 - 4096 = 16,896 B.
    """
    f = phase(0, "forward", start=cpu(weights=4096, inputs=512),
              peak=cpu(weights=4096, inputs=512, activations=3072, temporaries=1024),
              end=cpu(weights=4096, inputs=512, activations=3072))
    b = phase(0, "backward", start=cpu(weights=4096, inputs=512, activations=3072),
              peak=cpu(weights=4096, gradients=4096, inputs=512, activations=1536),
              end=cpu(weights=4096, gradients=4096, inputs=512))
    o = phase(0, "optimizer", start=cpu(weights=4096, gradients=4096, inputs=512),
              peak=cpu(weights=4096, gradients=4096, optimizer_states=8192, inputs=512, temporaries=4096),
              end=cpu(weights=4096, gradients=4096, optimizer_states=8192, inputs=512))
    return Report(trace(phases=(f, b, o), num_steps=1, **extra))


PEAK_TABLE = """\
Breakdown at the peak (exact mode, cpu):
  weights                    4.0 KiB          4096 B
  buffers                        0 B             0 B
  gradients                  4.0 KiB          4096 B
  optimizer_states           8.0 KiB          8192 B
  activations                    0 B             0 B
  inputs                       512 B           512 B
  kv_cache              not measured
  communication         not measured
  temporaries                4.0 KiB          4096 B
  allocator_overhead    not measured
  outside_torch         not measured
  total                     20.5 KiB         20992 B"""


def test_budgets_at_the_measured_figures_pass_and_say_what_they_judged():
    rep = _run()
    assert rep.peak.total == 20_992 and rep.end.total == 16_896
    result = check_budget(rep, total="20.5 KiB", optimizer_states=8192, activations=0)
    assert isinstance(result, BudgetResult) and result.at == "peak"
    # In the order given; "20.5 KiB" is 20.5 * 1024 = 20,992 bytes, equal passes.
    assert list(result) == ["total", "optimizer_states", "activations"]
    assert result["total"] == Judged(20_992, 20_992) and result["total"].headroom == 0
    assert result[Category.OPTIMIZER_STATES] == Judged(8192, 8192)
    assert result["activations"] == Judged(0, 0)  # nothing saved at the optimizer's peak: 0 passes a 0 budget
    assert repr(result) == ("<BudgetResult at=peak {total: 20992 <= 20992, optimizer_states: 8192 <= 8192, "
                            "activations: 0 <= 0}>")
    # SI units are powers of 1000: 21 kB = 21,000 B, 8 bytes of headroom over 20,992.
    assert check_budget(rep, total="21 kB")["total"].headroom == 21_000 - 20_992 == 8


def test_one_byte_over_names_each_overrun_then_the_breakdown():
    with pytest.raises(MemoryBudgetExceeded) as info:
        check_budget(_run(), total=20_991, temporaries="4 KiB", optimizer_states="8191 B")
    # Two of the three fail by one byte each; temporaries, at 4096 B, are within their 4 KiB = 4096 B.
    assert str(info.value) == textwrap.dedent("""\
        memory budget exceeded (2 of 3 budget(s)):
          peak total: measured 20.5 KiB (20992 B) > budget 20.5 KiB (20991 B), over by 1 B
          optimizer_states at the peak: measured 8.0 KiB (8192 B) > budget 8.0 KiB (8191 B), over by 1 B

        """) + PEAK_TABLE
    assert info.value.overruns == {"total": Judged(20_991, 20_992), "optimizer_states": Judged(8191, 8192)}
    assert isinstance(info.value, AssertionError) and isinstance(info.value, MemprofError)


def test_at_end_judges_the_categories_when_profiling_ended_and_the_total_still_at_the_peak():
    rep = _run()
    # The temporaries: 4096 B at the peak, none at the end.
    with pytest.raises(MemoryBudgetExceeded, match=r"temporaries at the peak: measured 4.0 KiB \(4096 B\) > "
                                                   r"budget 0 B, over by 4.0 KiB \(4096 B\)"):
        check_budget(rep, temporaries=0)
    result = check_budget(rep, total=20_992, temporaries=0, at="end")
    assert result.at == "end" and result["temporaries"] == Judged(0, 0)
    # "total" is the session's highest total whatever ``at`` says: 20,992, not the end's 16,896.
    assert result["total"] == Judged(20_992, 20_992)
    with pytest.raises(MemoryBudgetExceeded) as info:
        check_budget(rep, gradients=4095, at="end")
    # Both breakdowns follow: the end's has no temporaries and 16,896 B (16.5 KiB) in all.
    end_table = (PEAK_TABLE.replace("peak (", "end (")
                 .replace("temporaries                4.0 KiB          4096 B",
                          "temporaries                    0 B             0 B")
                 .replace("total                     20.5 KiB         20992 B",
                          "total                     16.5 KiB         16896 B"))
    assert str(info.value) == ("memory budget exceeded (1 of 1 budget(s)):\n"
                               "  gradients at the end: measured 4.0 KiB (4096 B) > budget 4.0 KiB (4095 B), "
                               "over by 1 B\n\n" + PEAK_TABLE + "\n\n" + end_table)


def test_every_category_takes_its_own_budget():
    rep = _run()
    figures = {"weights": 4096, "buffers": 0, "gradients": 4096, "optimizer_states": 8192, "activations": 0,
               "inputs": 512, "temporaries": 4096}
    assert {k: v.measured for k, v in check_budget(rep, **figures).items()} == figures
    for name, value in figures.items():
        with pytest.raises(MemoryBudgetExceeded) as info:
            check_budget(rep, **{name: value - 1}) if value else check_budget(rep, **{name: "0 B", "inputs": 511})
        over = name if value else "inputs"
        assert list(info.value.overruns) == [over]


def test_bad_budgets_are_refused_with_the_fix():
    rep = _run()
    names = ("total, weights, buffers, gradients, optimizer_states, activations, inputs, kv_cache, communication, "
             "temporaries, allocator_overhead, outside_torch")
    cases = [
        (dict(activation=1), UnknownNameError, f"unknown budget name 'activation'; use one of: {names}"),
        (dict(total="lots"), SizeParseError, "budget total='lots': cannot parse size 'lots'; write a number and a "
                                             "unit such as '1.5 GiB', '512 MB' or '4096'"),
        (dict(total="-1 B"), SizeParseError, "budget total='-1 B': cannot parse size '-1 B'; write a number and a "
                                             "unit such as '1.5 GiB', '512 MB' or '4096'"),
        (dict(total=True), SizeParseError, "budget total=True: size True is a boolean; give bytes as an int or a "
                                           "string like '2 GiB'"),
        (dict(), InvalidArgumentError, f"no budget was given; name at least one, e.g. total='1 GiB' (names: {names})"),
        (dict(total=1, at="start"), InvalidArgumentError, "at must be 'peak' or 'end', got 'start'"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error) as info:
            check_budget(rep, **kwargs)
        assert str(info.value) == message, kwargs
        assert isinstance(info.value, MemprofError)
    with pytest.raises(InvalidArgumentError) as info:
        check_budget(rep.trace, total=1)
    assert str(info.value) == ("check_budget() needs a memprof.Report, got Trace; pass prof.report() or "
                               "memprof.load(path)")


def _light():
    def light(**kw):  # light mode on CPU: temporaries and the total are not measured
        return bd(None, **{"weights": 0, "buffers": 0, "gradients": 0, "optimizer_states": 0, "activations": 0,
                           "inputs": 0, **kw})

    f = phase(0, "forward", start=light(weights=4096), peak=light(weights=4096, activations=2048),
              end=light(weights=4096))
    return Report(trace(mode="light", phases=(f,), num_steps=1))


def test_a_budget_on_what_was_not_measured_never_passes():
    with pytest.raises(BudgetNotMeasured) as info:
        check_budget(_light(), temporaries=10**12, total=10**12, weights=4096)
    assert str(info.value) == (
        "memory budget cannot be judged: peak total, temporaries at the peak not measured in this run "
        "(mode light, device cpu); a budget on an unmeasured figure never passes: profile with mode='exact' "
        "(exact on any device) or drop that budget")
    assert info.value.names == ("total", "temporaries")  # the total first, as every list of budgets names it
    # What light mode measures is judged as exact mode's is.
    assert check_budget(_light(), weights=4096)["weights"] == Judged(4096, 4096)
    # The device rows exist only on an accelerator: the fix says so, in exact mode too.
    with pytest.raises(BudgetNotMeasured) as info:
        check_budget(_run(), allocator_overhead=1, outside_torch="1 GiB")
    assert str(info.value) == (
        "memory budget cannot be judged: allocator_overhead at the peak, outside_torch at the peak not measured "
        "in this run (mode exact, device cpu); a budget on an unmeasured figure never passes: those figures exist "
        "only on an accelerator (CUDA); drop the budget where none is used")


def test_a_profile_without_a_step_cannot_be_judged():
    with pytest.raises(BudgetNotMeasured) as info:
        check_budget(Report(trace(num_steps=0)), total="1 GiB")
    assert str(info.value) == ("the profile recorded no step, so nothing was measured and the budget cannot be "
                               "judged; run the training (or inference) step inside 'with memprof.profile(...)'")
    assert info.value.names == ("total",)


def test_growth_against_a_baseline_is_judged_exactly_at_the_tolerance():
    base = _run()
    # 5 % of the 4096-byte weights is 204.8 B: 204 more bytes are within, 205 are not.
    grown = Report(trace(phases=(phase(0, "forward", start=cpu(), peak=cpu(weights=4096 + 205, inputs=512),
                                       end=cpu()),), num_steps=1))
    within = Report(trace(phases=(phase(0, "forward", start=cpu(), peak=cpu(weights=4096 + 204), end=cpu()),),
                          num_steps=1))
    assert compare_to_baseline(within, base, "5%") == ()
    growths = compare_to_baseline(grown, base, 0.05)
    # The peak total fell (20,992 -> 4,813) and inputs stayed at 512: only the weights grew.
    assert [(g.name, g.baseline, g.measured, g.delta) for g in growths] == [("weights", 4096, 4301, 205)]
    with pytest.raises(MemoryGrewError) as info:
        compare_to_baseline(grown, base, "5%", raise_on_growth=True)
    # 205 / 4096 = 5.0049 %, shown to one decimal.
    assert str(info.value) == describe_growth(growths, "5%") == (
        "memory grew beyond the 5% tolerance against the baseline:\n"
        "  weights: 4.0 KiB (4096 B) -> 4.2 KiB (4301 B), +205 B (+5.0%)")
