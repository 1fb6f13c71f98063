"""The pytest plugin (fixture, marker, options) and check_budget.

Budgets are tested just under and just over the limit: the limit is first
measured here, in the outer test, with the same code the inner test runs. On
CPU in exact mode every figure is exact and repeatable, so "measured" passes
and "measured - 1 byte" fails, with no tolerance.
"""

import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import textwrap
from fractions import Fraction

import pytest
import torch
# Imported here, before any pytester.inline_run: an inline run restores sys.modules when it ends, and a
# torch._dynamo imported inside one (torch.compile, memprof's step hooks) registers a torch library
# that cannot be registered twice when the next inline run imports it again.
import torch._dynamo

import memprof
from memprof.analyse.budget import (
    BudgetResult,
    Judged,
    check_budget,
    compare_to_baseline,
    parse_budgets,
    parse_tolerance,
)
from memprof.errors import (BudgetNotMeasured, InvalidArgumentError, MemoryBudgetExceeded, MemoryGrewError,
                            MemprofError, SizeParseError, UnknownNameError)
from memprof.pytest_plugin import report_file_names
from memprof.record.trace import Breakdown

pytest_plugins = ["pytester"]

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The step every inner test profiles. Sequential(Linear(8, 16), ReLU, Linear(16, 4)) has
# 8*16 + 16 + 16*4 + 4 = 212 fp32 parameters = 848 B of weights.
STEP = '''
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def run_step(model, opt):
    x = torch.randn(4, 8)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
'''

WEIGHTS = (8 * 16 + 16 + 16 * 4 + 4) * 4  # 848 B
# Adam keeps exp_avg and exp_avg_sq (fp32, like the weights) and a 4-byte fp32 `step` per parameter tensor (4 tensors).
ADAM_STATES = 2 * WEIGHTS + 4 * 4  # 1712 B


def _measure(mode="exact"):
    ns: dict = {}
    exec(STEP, ns)
    model, opt = ns["make"]()
    with memprof.profile(model, opt, mode=mode) as prof:
        ns["run_step"](model, opt)
    return prof.report()


@pytest.fixture(scope="module")
def rep():
    return _measure()


@pytest.fixture(scope="module")
def light_rep():
    return _measure("light")


def _outcomes(rec):
    """test name -> (outcome, failure text) of the call phase (or of a failed setup)."""
    out = {}
    for r in rec.getreports("pytest_runtest_logreport"):
        if r.when == "call" or (r.when == "setup" and not r.passed):
            out[r.nodeid.split("::")[-1]] = (r.outcome, str(r.longrepr) if r.longrepr else "")
    return out


def _inner_test(name, marker, body="run_step(model, opt)", mode="exact"):
    marker_line = f"@pytest.mark.memory_budget({marker})\n" if marker is not None else ""
    return (
        f"\n{marker_line}def {name}(memory_profile):\n"
        f"    model, opt = make()\n"
        f"    with memory_profile(model, opt, mode={mode!r}) as prof:\n"
        f"        {body}\n"
    )


# A second, fresh model profiled after the first (same figures as the first).
TWO = "run_step(model, opt)\n    model, opt = make()\n    with memory_profile(model, opt):\n        run_step(model, opt)"


def _write(pytester, name, *tests):
    pytester.makepyfile(**{name: "import pytest\n" + STEP + "".join(tests)})


# ---------------------------------------------------------------------------- sanity of the measurement


def test_the_measurement_is_exact_and_repeatable(rep):
    assert rep.peak["weights"] == WEIGHTS
    # The peak is inside Adam's step: every gradient is live, one per weight.
    assert rep.peak["gradients"] == WEIGHTS
    assert rep.end["optimizer_states"] == ADAM_STATES
    again = _measure()
    assert again.peak == rep.peak and again.end == rep.end


# ---------------------------------------------------------------------------- the marker, just under / just over


def test_budgets_pass_at_the_measured_figure_and_fail_one_byte_below(pytester, rep):
    # The step counters Adam makes with torch.tensor() are counted when made: at the peak, inside the
    # step, the states are complete. Gradients are at the peak but gone at the end (zero_grad).
    assert rep.peak["optimizer_states"] == rep.end["optimizer_states"] == ADAM_STATES
    assert rep.peak["gradients"] == WEIGHTS and rep.end["gradients"] == 0
    peak = rep.peak.total
    grads = rep.peak["gradients"]  # 848 B
    states_end = rep.end["optimizer_states"]  # 1712 B
    _write(
        pytester, "test_inner",
        _inner_test("test_peak_under", f"total={peak}"),
        _inner_test("test_peak_over", f"total={peak - 1}"),
        _inner_test("test_category_under", f"gradients='{grads} B'"),
        _inner_test("test_category_over", f"gradients={grads - 1}"),
        _inner_test("test_end_under", f"optimizer_states={states_end}, at='end'"),
        _inner_test("test_end_over", f"optimizer_states={states_end - 1}, at='end'"),
        # The default judges the peak breakdown, where the gradients are (at the end they are gone).
        _inner_test("test_category_judged_at_peak_by_default", f"gradients={grads - 1}"),
    )
    out = _outcomes(pytester.inline_run("-p", "no:cacheprovider"))
    assert {k: v[0] for k, v in out.items()} == {
        "test_peak_under": "passed",
        "test_peak_over": "failed",
        "test_category_under": "passed",
        "test_category_over": "failed",
        "test_end_under": "passed",
        "test_end_over": "failed",
        "test_category_judged_at_peak_by_default": "failed",
    }
    msg = out["test_peak_over"][1]
    assert "MemoryBudgetExceeded" in msg
    assert f"peak total: measured {memprof.format_bytes(peak)} ({peak} B) > budget" in msg
    assert f"({peak - 1} B)" in msg and "over by 1 B" in msg
    assert "Breakdown at the peak" in msg and re.search(r"weights\s+848 B\s+848 B", msg)
    assert "Traceback" not in msg and "pytest_plugin.py" not in msg  # the message only, no plugin internals
    msg = out["test_category_over"][1]
    assert f"gradients at the peak: measured {grads} B > budget {grads - 1} B, over by 1 B" in msg
    msg = out["test_end_over"][1]
    assert "optimizer_states at the end: measured 1.7 KiB (1712 B) > budget 1.7 KiB (1711 B), over by 1 B" in msg
    assert "Breakdown at the end" in msg


def test_several_overruns_and_several_profiles_are_all_reported(pytester, rep):
    _write(pytester, "test_inner",
           _inner_test("test_two", f"weights={WEIGHTS - 1}, gradients={WEIGHTS - 2}", body=TWO))
    out = _outcomes(pytester.inline_run())
    outcome, msg = out["test_two"]
    assert outcome == "failed"
    assert "(profile 1 of 2)" in msg and "(profile 2 of 2)" in msg
    assert msg.count("over by 1 B") == 2 and msg.count("over by 2 B") == 2


def test_closest_marker_wins_per_name(pytester):
    # Module marker: weights 1 byte too small, gradients generous. The function's marker loosens weights only.
    _write(
        pytester, "test_inner",
        f"\npytestmark = pytest.mark.memory_budget(weights={WEIGHTS - 1}, gradients='1 MiB')\n",
        _inner_test("test_module_budget", None),
        _inner_test("test_loosened", f"weights={WEIGHTS}"),
    )
    out = _outcomes(pytester.inline_run())
    assert out["test_module_budget"][0] == "failed" and "weights at the peak" in out["test_module_budget"][1]
    assert out["test_loosened"][0] == "passed"


# ---------------------------------------------------------------------------- what cannot be judged


def test_nothing_measured_fails(pytester):
    pytester.makepyfile(test_inner="import pytest\n" + STEP + textwrap.dedent('''
        @pytest.mark.memory_budget(total="1 GiB")
        def test_no_fixture():
            model, opt = make()
            run_step(model, opt)

        @pytest.mark.memory_budget(total="1 GiB")
        def test_never_entered(memory_profile):
            model, opt = make()
            memory_profile(model, opt)

        @pytest.mark.memory_budget(total="1 GiB")
        def test_no_step(memory_profile):
            model, opt = make()
            with memory_profile(model, opt):
                pass

        def test_unmarked_fixture_is_not_judged(memory_profile):
            model, opt = make()
            with memory_profile(model, opt):
                run_step(model, opt)
            assert len(memory_profile.reports) == 1
    '''))
    out = _outcomes(pytester.inline_run())
    for name in ("test_no_fixture", "test_never_entered", "test_no_step"):
        assert out[name][0] == "failed", name
        assert "nothing was measured" in out[name][1], name
    assert "recorded no step" in out["test_no_step"][1]
    assert out["test_unmarked_fixture_is_not_judged"][0] == "passed"


def test_budget_on_unmeasured_category_fails(pytester):
    # Light mode on CPU has no allocator counter: temporaries and the total are not measured.
    _write(
        pytester, "test_inner",
        _inner_test("test_light_temporaries", "temporaries='1 GiB'", mode="light"),
        _inner_test("test_light_peak", "total='1 GiB'", mode="light"),
        _inner_test("test_light_weights", f"weights={WEIGHTS}", mode="light"),
        _inner_test("test_allocator_overhead_on_cpu", "allocator_overhead='1 GiB'"),
    )
    out = _outcomes(pytester.inline_run())
    for name in ("test_light_temporaries", "test_light_peak", "test_allocator_overhead_on_cpu"):
        assert out[name][0] == "failed", name
        assert "BudgetNotMeasured" in out[name][1] and "not measured" in out[name][1], name
    assert "temporaries at the peak not measured" in out["test_light_temporaries"][1]
    assert "accelerator" in out["test_allocator_overhead_on_cpu"][1]
    assert out["test_light_weights"][0] == "passed"  # weights are walked in light mode too


def test_bad_marker_values_fail_quoting_them(pytester):
    _write(
        pytester, "test_inner",
        _inner_test("test_bad_size", "total='1.5 GB-ish'"),
        _inner_test("test_bad_unit", "activations='3 parsecs'"),
        _inner_test("test_negative", "weights=-1"),
        _inner_test("test_unknown_name", "peak='1 GiB'"),
        _inner_test("test_positional", "'1 GiB'"),
        _inner_test("test_bad_at", "weights='1 GiB', at='start'"),
    )
    pytester.makepyfile(test_unmeasured_bad="""
        import pytest
        @pytest.mark.memory_budget(total="lots")
        def test_bad_size_nothing_measured():
            pass
    """)
    out = _outcomes(pytester.inline_run())
    assert all(v[0] == "failed" for v in out.values()), out
    assert "'1.5 GB-ish'" in out["test_bad_size"][1]
    assert "'3 parsecs'" in out["test_bad_unit"][1] and "unknown unit" in out["test_bad_unit"][1]
    assert "weights=-1" in out["test_negative"][1] and "negative" in out["test_negative"][1]
    assert "'peak'" in out["test_unknown_name"][1] and "optimizer_states" in out["test_unknown_name"][1]
    assert "keyword arguments only" in out["test_positional"][1]
    assert "'start'" in out["test_bad_at"][1]
    # The size is reported even when nothing was measured: the marker is checked first.
    assert "'lots'" in out["test_bad_size_nothing_measured"][1]


def test_a_failing_body_is_reported_as_itself(pytester):
    _write(pytester, "test_inner",
           _inner_test("test_raises", "total=1", body="run_step(model, opt)\n    raise ValueError('boom')"))
    out = _outcomes(pytester.inline_run())
    assert out["test_raises"][0] == "failed"
    assert "ValueError: boom" in out["test_raises"][1]
    assert "MemoryBudgetExceeded" not in out["test_raises"][1]


def test_record_adds_a_report_made_elsewhere(pytester, rep):
    pytester.makepyfile(test_inner="import pytest, memprof\n" + STEP + textwrap.dedent(f'''
        @pytest.mark.memory_budget(weights={WEIGHTS - 1})
        def test_recorded(memory_profile):
            model, opt = make()
            with memprof.profile(model, opt) as prof:
                run_step(model, opt)
            assert memory_profile.record(prof.report()) is memory_profile.reports[0]
    '''))
    out = _outcomes(pytester.inline_run())
    assert out["test_recorded"][0] == "failed" and "over by 1 B" in out["test_recorded"][1]


# ---------------------------------------------------------------------------- save dir and baselines


def test_save_dir_writes_loadable_json(pytester, rep):
    _write(pytester, "test_inner",
           _inner_test("test_one", None),
           _inner_test("test_two", None, body=TWO),
           _inner_test("test_fails", None, body="run_step(model, opt)\n        assert False"))
    result = pytester.runpytest("--memprof-save-dir", "reports")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["memprof: wrote 4 report(s) to *reports"])
    folder = pytester.path / "reports"
    assert sorted(p.name for p in folder.iterdir()) == [
        "test_inner.py%3A%3Atest_fails.json",  # saved although the test failed
        "test_inner.py%3A%3Atest_one.json",
        "test_inner.py%3A%3Atest_two.json",
        "test_inner.py%3A%3Atest_two~2.json",
    ]
    for path in folder.iterdir():
        loaded = memprof.load(path)
        assert loaded.peak == rep.peak and loaded.end == rep.end
        assert json.loads(path.read_text())["format"] == "memprof.trace"


def _baseline(pytester, rep, weights_before):
    """A baseline file for test_inner.py::test_step whose peak weights were ``weights_before``."""
    peak = rep.peak.to_dict()
    peak["weights"] = weights_before
    peak["total"] = rep.peak.total - (rep.peak["weights"] - weights_before)
    folder = pytester.path / "base"
    folder.mkdir(exist_ok=True)
    # A peak below its phases' (the weights grew since): the file names no step and phase for it (the loader
    # holds a named one to its phases' peaks).
    trace = dataclasses.replace(rep.trace, peak=Breakdown.from_dict(peak), peak_step=None, peak_phase=None)
    memprof.Report(trace).save(folder / "test_inner.py%3A%3Atest_step.json")
    return folder


def test_baseline_fails_on_growth_beyond_tolerance(pytester, rep):
    _write(pytester, "test_inner", _inner_test("test_step", None))
    # 808 * 1.05 = 848.4 >= 848: within 5%. 807 * 1.05 = 847.35 < 848: grew too much.
    _baseline(pytester, rep, 808)
    pytester.runpytest("--memprof-baseline", "base").assert_outcomes(passed=1)
    _baseline(pytester, rep, 807)
    result = pytester.runpytest("--memprof-baseline", "base")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*memory grew beyond the 5% tolerance against the baseline:*",
        "*weights: 807 B -> 848 B, +41 B (+5.1%)*",
    ])
    # The total grew by 41 B of about 4.5 KiB: well within, so it is not listed.
    assert "peak total:" not in result.stdout.str()
    # A wider tolerance, in both spellings, lets it pass.
    pytester.runpytest("--memprof-baseline", "base", "--memprof-tolerance", "6%").assert_outcomes(passed=1)
    pytester.runpytest("--memprof-baseline", "base", "--memprof-tolerance=0.06").assert_outcomes(passed=1)


def test_baseline_missing_file_warns_and_bad_options_are_usage_errors(pytester, rep):
    _write(pytester, "test_inner", _inner_test("test_step", None))
    (pytester.path / "empty").mkdir()
    result = pytester.runpytest("--memprof-baseline", "empty")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*BaselineMissingWarning: memprof: no baseline test_inner.py%3A%3Atest_step.json*"])
    result = pytester.runpytest("--memprof-baseline", "nowhere")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--memprof-baseline nowhere: no such directory*"])
    result = pytester.runpytest("--memprof-baseline", "empty", "--memprof-tolerance", "lots")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--memprof-tolerance: cannot parse tolerance 'lots'*"])


@pytest.mark.parametrize("args,message", [
    (("--memprof-save-dir", "afile"), "*--memprof-save-dir afile: this is a file, not a folder*"),
    (("--memprof-save-dir", ""), "*--memprof-save-dir is empty*"),
    (("--memprof-baseline", ""), "*--memprof-baseline is empty*"),
    (("--memprof-baseline", " "), "*--memprof-baseline is empty*"),
])
def test_option_mistakes_are_usage_errors_at_start_up(pytester, args, message):
    _write(pytester, "test_inner", _inner_test("test_step", None))
    (pytester.path / "afile").write_text("not a folder")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert not (pytester.path / "test_inner.py%3A%3Atest_step.json").exists()  # not the current directory


def test_a_save_folder_that_cannot_be_made_is_one_usage_error_at_start_up(pytester):
    _write(pytester, "test_inner", _inner_test("test_one", None), _inner_test("test_two", None))
    (pytester.path / "afile").write_text("not a folder")
    result = pytester.runpytest("--memprof-save-dir", "afile/reports")  # a file on the way
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--memprof-save-dir afile/reports: memprof cannot create or write this folder*"])
    assert "collected" not in result.stdout.str()  # refused before any test ran


GROWN = """
import torch
from torch import nn

WIDTH = {width}


def test_step(memory_profile):
    model = nn.Linear(8, WIDTH, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memory_profile(model, opt):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
"""


def test_saving_over_the_baseline_being_compared_with_is_refused(pytester, rep):
    # (rep: what a profile imports lazily is imported here, outside pytester's runs, which forget it)
    # The baseline: Linear(8, 16) without bias, 8 * 16 * 4 = 512 B of weights.
    pytester.makepyfile(test_grown=GROWN.format(width=16))
    pytester.runpytest("--memprof-save-dir", "base").assert_outcomes(passed=1)
    baseline = (pytester.path / "base" / "test_grown.py%3A%3Atest_step.json").read_bytes()
    # The model grows 64 times: 8 * 1024 * 4 = 32 KiB of weights. Saving into the folder being compared
    # with would replace each baseline by the grown report before (or after) comparing: refused, in
    # every spelling of that folder.
    pytester.makepyfile(test_grown=GROWN.format(width=1024))
    (pytester.path / "alias").symlink_to("base")
    for spelling in ("base", "./base/", "alias"):
        result = pytester.runpytest("--memprof-save-dir", spelling, "--memprof-baseline", "base")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, spelling
        result.stderr.fnmatch_lines(["*--memprof-save-dir * and --memprof-baseline base are one folder*"])
    assert (pytester.path / "base" / "test_grown.py%3A%3Atest_step.json").read_bytes() == baseline
    result = pytester.runpytest("--memprof-baseline", "base", "--memprof-save-dir", "new")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*MemoryGrewError*", "*weights: 512 B -> 32.0 KiB (32768 B)*"])


def test_a_report_that_cannot_be_saved_fails_its_test_with_one_line(pytester, rep):
    _write(pytester, "test_inner", _inner_test("test_step", None),
           _inner_test("test_fails", None, body="run_step(model, opt)\n        assert False, 'the body'"))
    blocked = pytester.path / "reports" / "test_inner.py%3A%3Atest_step.json"
    blocked.mkdir(parents=True)  # a folder where the report goes
    (pytester.path / "reports" / "test_inner.py%3A%3Atest_fails.json").mkdir()
    out = _outcomes(pytester.inline_run("--memprof-save-dir", "reports", "-W", "error", "-p", "no:cacheprovider"))
    outcome, text = out["test_step"]
    assert outcome == "failed"
    assert text == (f"memprof could not save this test's report to {blocked}: cannot save to {blocked}: it is a "
                    "folder; give a file name such as run.json")
    # A test whose body failed reports its own failure, even with warnings made errors.
    assert out["test_fails"][0] == "failed" and "AssertionError: the body" in out["test_fails"][1]


def test_a_saved_report_follows_a_link_at_its_name(pytester, rep):
    _write(pytester, "test_inner", _inner_test("test_step", None))
    (pytester.path / "reports").mkdir()
    (pytester.path / "kept").mkdir()
    link = pytester.path / "reports" / "test_inner.py%3A%3Atest_step.json"
    link.symlink_to("../kept/step.json")
    pytester.runpytest("--memprof-save-dir", "reports").assert_outcomes(passed=1)
    assert link.is_symlink() and memprof.load(pytester.path / "kept" / "step.json").num_steps == 1


def test_the_summary_counts_reports_written_by_xdist_workers(pytester):
    pytest.importorskip("xdist")
    _write(pytester, "test_inner", _inner_test("test_one", None), _inner_test("test_two", None, body=TWO),
           _inner_test("test_three", None))
    result = pytester.runpytest("-n", "2", "-p", "xdist", "--memprof-save-dir", "reports")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["memprof: wrote 4 report(s) to *reports"])
    assert len(list((pytester.path / "reports").iterdir())) == 4


def test_the_docs_example_passes(pytester):
    text = (ROOT / "docs" / "pytest.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "memory_budget" in b)
    pytester.makepyfile(test_docs_example=example)
    pytester.inline_run().assertoutcome(passed=1)


def test_the_plugin_module_imports_neither_torch_nor_memprof_at_load():
    # Loaded by path, outside the package: its top level may only need pytest and the stdlib,
    # so that registering the plugin costs nothing in projects that never use it.
    code = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("probe", {str(ROOT / "memprof" / "pytest_plugin.py")!r})
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "memprof", "pandas")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    assert out.strip() == "[]"


def test_file_names_are_sanitised_and_indexed():
    assert report_file_names("tests/test_a.py::test_b[x/y-1]", 1) == [
        "tests%2Ftest_a.py%3A%3Atest_b%5Bx%2Fy-1%5D.json"]
    assert report_file_names("t.py::C::test", 3) == [
        "t.py%3A%3AC%3A%3Atest.json", "t.py%3A%3AC%3A%3Atest~2.json", "t.py%3A%3AC%3A%3Atest~3.json"]
    long = report_file_names("t.py::test[" + "x" * 300 + "]", 1)[0]
    assert len(long) < 220 and long != report_file_names("t.py::test[" + "x" * 301 + "]", 1)[0]


@pytest.mark.parametrize("ids", [
    ("t.py::test[fp32/large]", "t.py::test[fp32_large]"),  # "/" and "_" once both became "_"
    ("t.py::test[a b]", "t.py::test[a_b]", "t.py::test[a-b]", "t.py::test[a%20b]"),
    ("t.py::test[.x]", "t.py::test[%2Ex]", "t.py::test[~]", "t.py::test[%7E]"),
    ("t.py::test_two", "t.py::test_two~2", "t.py::test_two--2"),  # a second report against another's first
])
def test_file_names_are_unique_and_reversible(ids):
    from urllib.parse import unquote

    names = [n for nodeid in ids for n in report_file_names(nodeid, 2)]
    assert len(set(names)) == len(names)
    for nodeid in ids:
        first = report_file_names(nodeid, 1)[0]
        assert unquote(first[: -len(".json")]) == nodeid
        assert not first.startswith(".") and "/" not in first


# ---------------------------------------------------------------------------- check_budget directly


def test_check_budget_passes_at_the_figure_and_returns_what_it_judged(rep):
    result = check_budget(rep, total=rep.peak.total, gradients=WEIGHTS, buffers=0, activations=0)
    assert isinstance(result, BudgetResult) and result.at == "peak"
    assert list(result) == ["total", "gradients", "buffers", "activations"]
    assert result["gradients"] == Judged(848, 848) == (848, 848)
    assert result[memprof.Category.GRADIENTS].headroom == 0
    assert result["total"] == (rep.peak.total, rep.peak.total)


def test_check_budget_units(rep):
    # 848 B of weights: "1 KiB" = 1024 B passes; "0.5 KiB" = 512 B fails;
    # SI: "0.848 kB" = 848 B passes, "0.847 kB" = 847 B fails by 1 B.
    check_budget(rep, weights="1 KiB")
    check_budget(rep, weights="0.848 kB")
    check_budget(rep, weights="848")
    with pytest.raises(MemoryBudgetExceeded, match="over by 336 B"):  # 848 - 512
        check_budget(rep, weights="0.5 KiB")
    with pytest.raises(MemoryBudgetExceeded, match="over by 1 B"):
        check_budget(rep, weights="0.847 kB")


def test_check_budget_overrun_message_and_attributes(rep):
    with pytest.raises(MemoryBudgetExceeded) as info:
        check_budget(rep, total=rep.peak.total - 1, weights=WEIGHTS - 8, gradients="1 MiB")
    exc = info.value
    assert isinstance(exc, AssertionError) and isinstance(exc, MemprofError)
    assert set(exc.overruns) == {"total", "weights"}
    assert exc.overruns["weights"] == (840, 848)
    text = str(exc)
    assert text.startswith("memory budget exceeded (2 of 3 budget(s)):")
    assert "weights at the peak: measured 848 B > budget 840 B, over by 8 B" in text
    assert "gradients" in text  # in the breakdown table, not as an overrun
    assert "gradients at the peak" not in text
    assert re.search(rf"total\s+\S+ \S+\s+{rep.peak.total} B", text)


def test_check_budget_at_end(rep):
    # At the end: weights 848 + Adam states 1712 = 2560 B; gradients were zeroed (set to None).
    assert rep.end.total == WEIGHTS + ADAM_STATES == 2560
    check_budget(rep, at="end", optimizer_states=ADAM_STATES, gradients=0)
    with pytest.raises(MemoryBudgetExceeded, match="optimizer_states at the end: measured 1.7 KiB"):
        check_budget(rep, at="end", optimizer_states=ADAM_STATES - 1)
    # total= is the session's peak total whatever `at` says.
    assert check_budget(rep, at="end", total=rep.peak.total)["total"].measured == rep.peak.total > rep.end.total
    with pytest.raises(InvalidArgumentError, match="'start'"):
        check_budget(rep, at="start", weights=1)


def test_check_budget_zero_means_none_of_it(rep):
    check_budget(rep, buffers=0)
    with pytest.raises(MemoryBudgetExceeded, match="over by 848 B"):
        check_budget(rep, weights=0)


@pytest.mark.parametrize("value, words", [
    (-1, "negative"),
    (float("nan"), "finite"),
    (float("inf"), "finite"),
    (True, "boolean"),
    ("lots", "cannot parse"),
    ("3 parsecs", "unknown unit"),
    ("-5 MiB", "cannot parse"),
    ([1], "type list"),
])
def test_check_budget_bad_sizes(rep, value, words):
    with pytest.raises(SizeParseError, match=words) as info:
        check_budget(rep, activations=value)
    assert repr(value) in str(info.value) and "activations" in str(info.value)


def test_check_budget_bad_names_and_arguments(rep):
    with pytest.raises(UnknownNameError, match=r"'peak'.*total, weights.*optimizer_states"):
        check_budget(rep, peak="1 GiB")
    with pytest.raises(UnknownNameError, match="'activation'"):
        check_budget(rep, activation=1)
    with pytest.raises(InvalidArgumentError, match="no budget"):
        check_budget(rep)
    with pytest.raises(InvalidArgumentError, match="needs a memprof.Report"):
        check_budget(rep.trace, total=1)
    assert parse_budgets(total="1 KiB", Activations="1 kB") == {"total": 1024, "activations": 1000}


def test_check_budget_refuses_what_was_not_measured(rep, light_rep):
    assert light_rep.peak["temporaries"] is None and light_rep.peak.total is None
    for kwargs in ({"temporaries": "1 GiB"}, {"total": "1 GiB"}):
        with pytest.raises(BudgetNotMeasured, match="not measured in this run") as info:
            check_budget(light_rep, **kwargs)
        assert isinstance(info.value, memprof.errors.NotMeasuredError)
    check_budget(light_rep, weights=WEIGHTS, gradients=WEIGHTS)  # walked from the model: measured
    with pytest.raises(BudgetNotMeasured, match="only on an accelerator"):
        check_budget(rep, outside_torch="1 GiB")
    # An unmeasured budget refuses even when another one is exceeded: it can never pass.
    with pytest.raises(BudgetNotMeasured) as info:
        check_budget(light_rep, weights=0, temporaries=0)
    assert info.value.names == ("temporaries",)


def test_check_budget_refuses_a_profile_without_steps():
    model = torch.nn.Linear(2, 2)
    with memprof.profile(model, mode="exact") as prof:
        pass
    with pytest.raises(BudgetNotMeasured, match="recorded no step"):
        check_budget(prof.report(), total="1 GiB")


def test_check_budget_on_a_loaded_report(rep, tmp_path):
    rep.save(tmp_path / "r.json")
    loaded = memprof.load(tmp_path / "r.json")
    assert dict(check_budget(loaded, total=rep.peak.total, weights=WEIGHTS)) == dict(
        check_budget(rep, total=rep.peak.total, weights=WEIGHTS))


# ---------------------------------------------------------------------------- baselines directly


def test_parse_tolerance():
    for spelling in ("5%", " 5 % ", 0.05, "0.05", Fraction(1, 20)):
        assert parse_tolerance(spelling) == Fraction(1, 20)
    assert parse_tolerance(0) == 0
    for bad in ("-1%", "lots", True, float("nan"), float("inf"), None):
        with pytest.raises(InvalidArgumentError):
            parse_tolerance(bad)


def _with_peak(rep, **changes):
    peak = rep.peak.to_dict()
    peak.update(changes)
    peak["total"] = sum(v for k, v in peak.items() if k != "total" and v is not None)
    return memprof.Report(dataclasses.replace(rep.trace, peak=Breakdown.from_dict(peak)))


def test_compare_to_baseline_exact_boundary(rep):
    assert compare_to_baseline(rep, rep) == ()
    # 848 * 21/20 = 890.4: 890 B is within 5%, 891 B is not. (The total, about 4.5 KiB, grows by < 1%.)
    assert compare_to_baseline(_with_peak(rep, weights=890), rep) == ()
    growths = compare_to_baseline(_with_peak(rep, weights=891), rep)
    assert [g.name for g in growths] == ["weights"]
    assert growths[0].delta == 43 and growths[0].baseline == 848
    assert compare_to_baseline(_with_peak(rep, weights=891), rep, "10%") == ()
    # Shrinking is never a failure; from 0, any growth is.
    assert compare_to_baseline(rep, _with_peak(rep, weights=2000)) == ()
    growths = compare_to_baseline(_with_peak(rep, buffers=1), rep, "50%")
    assert [(g.name, g.baseline, g.measured) for g in growths] == [("buffers", 0, 1)]
    assert "from nothing" in growths[0].describe()
    with pytest.raises(MemoryGrewError, match=r"weights: 848 B -> 891 B, \+43 B \(\+5.1%\)") as info:
        compare_to_baseline(_with_peak(rep, weights=891), rep, raise_on_growth=True)
    assert isinstance(info.value, AssertionError) and len(info.value.growths) == 1


def test_compare_to_baseline_skips_unmeasured(rep, light_rep):
    # light_rep lacks temporaries and the total; the measured categories are equal.
    assert compare_to_baseline(light_rep, rep) == ()


def test_a_gpu_budget_is_guarded_by_an_estimate_on_the_cpu(pytester):
    # The same step simulated for a CUDA target: 4 parameter tensors, each rounded up to the caching
    # allocator's 512-byte blocks, so weights are 4 * 512 = 2,048 B there (848 B on the CPU).
    est = memprof.estimate(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
                           lambda ps: torch.optim.Adam(ps, lr=1e-3), inputs=torch.randn(4, 8), device="cuda")
    # A budget's total is the breakdown's: for a CUDA target that is the device-level total (tensors, the caching
    # allocator's cache, the memory outside torch), as a measured CUDA run's is.
    peak = est.peak.total
    assert peak == est.peak_bytes + est.peak["allocator_overhead"] + est.peak["outside_torch"]
    assert est.trace.peak["weights"] == 4 * 512
    sim = (
        "    model, _ = make()\n"
        "    memory_profile.estimate(model, lambda ps: torch.optim.Adam(ps, lr=1e-3), inputs=torch.randn(4, 8))\n"
    )
    pytester.makepyfile(test_inner="import pytest\n" + STEP + f'''
@pytest.mark.memory_budget(total={peak}, estimate="cuda")
def test_fits(memory_profile):
{sim}

@pytest.mark.memory_budget(total={peak - 1}, estimate="cuda")
def test_one_byte_over(memory_profile):
{sim}

@pytest.mark.memory_budget(weights="2 KiB", estimate="cuda")
def test_weights_in_cuda_blocks(memory_profile):
{sim}

@pytest.mark.memory_budget(total="1 GiB", estimate="cuda")
def test_measured_instead(memory_profile):
    model, opt = make()
    with memory_profile(model, opt):
        run_step(model, opt)

@pytest.mark.memory_budget(total="1 GiB", estimate="tpu")
def test_unknown_device(memory_profile):
{sim}
''')
    out = _outcomes(pytester.inline_run("-p", "no:cacheprovider"))
    assert {k: v[0] for k, v in out.items()} == {
        "test_fits": "passed", "test_one_byte_over": "failed", "test_weights_in_cuda_blocks": "passed",
        "test_measured_instead": "failed", "test_unknown_device": "failed"}
    assert "over by 1 B" in out["test_one_byte_over"][1]
    assert "memory_profile.estimate(model, optimizer, inputs=...) instead of measuring it" in out["test_measured_instead"][1]
    assert "estimate must be 'cuda' or 'cpu'" in out["test_unknown_device"][1]


def test_an_estimated_device_may_be_spelled_with_its_index(pytester):
    pytester.makepyfile(test_inner="import pytest\n" + STEP + '''
@pytest.mark.memory_budget(total="2 GiB", estimate="cuda")  # the CUDA context's 1343 MiB ceiling is in the total
def test_cuda_1(memory_profile):
    model, _ = make()
    memory_profile.estimate(model, None, inputs=torch.randn(4, 8), device="cuda:1")
''')
    out = _outcomes(pytester.inline_run("-p", "no:cacheprovider"))
    assert out["test_cuda_1"][0] == "passed", out["test_cuda_1"][1]


RANKED = '''
import os
import torch.distributed as dist


def test_on_a_rank(memory_profile, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, opt = make()
        with memory_profile(model, opt):
            run_step(model, opt)
    finally:
        dist.destroy_process_group()
'''


def test_a_rank_saves_and_compares_under_its_own_name(pytester, rep):
    # Under torchrun every rank runs the test: rank N's report is <test id>@rank<N>.json, written and compared
    # per rank. A world of one gloo rank stands for each of them.
    import torch.distributed as dist

    # What a process group and a profile import lazily is imported here (and by the rep fixture), outside
    # pytester's runs: pytester forgets modules a run imported, and torch's operator libraries refuse to
    # register twice.
    dist.init_process_group("gloo", init_method=f"file://{pytester.path / 'warm'}", rank=0, world_size=1)
    dist.destroy_process_group()
    pytester.makepyfile(test_ranked="import pytest\n" + STEP + RANKED)
    result = pytester.runpytest("--memprof-save-dir", "reports")
    result.assert_outcomes(passed=1)
    names = [p.name for p in (pytester.path / "reports").iterdir()]
    assert names == ["test_ranked.py%3A%3Atest_on_a_rank@rank0.json"]
    assert memprof.load(pytester.path / "reports" / names[0]).rank == 0
    result = pytester.runpytest("--memprof-baseline", "reports")
    result.assert_outcomes(passed=1)
    assert "no baseline" not in result.stdout.str()
