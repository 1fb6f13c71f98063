"""Results are records, views are renderers (issue 37 item 3): each result is one frozen class, its views are
functions registered on it from above (memprof.record.views), renderers run no analysis, and the floors below
recognise a record by its type, never by its name."""

from __future__ import annotations

import ast
import dataclasses
import html
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import memprof
from memprof.errors import InvalidArgumentError, RegistryError
from memprof.record import views
from memprof.record.estimate import Estimate, WhatIf
from memprof.render.plan import what_if_text

from factories import full_trace

RENDER = Path(memprof.__file__).parent / "render"


def test_the_facade_defines_no_result_class_of_its_own():
    # The facade once held a look-alike subclass of every result (filled by copying fields); the records are
    # now the public classes, so the facade's own classes are the Report and the Profiler, and nothing else.
    import memprof.report as facade

    own = set()
    for info in pkgutil.iter_modules(facade.__path__):
        module = importlib.import_module(f"memprof.report.{info.name}")
        own |= {name for name, cls in inspect.getmembers(module, inspect.isclass) if cls.__module__ == module.__name__}
    assert own == {"Report", "Profiler"}


def _runtime_imports(tree: ast.Module) -> "list[ast.ImportFrom]":
    """The ``from ... import`` statements of a module that run (those under ``if TYPE_CHECKING:`` do not)."""
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
               for stmt in node.body for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and id(n) not in skipped]


def test_renderers_run_no_analysis():
    # A renderer is handed what an analysis computes (the facade computes it): from analyse/ and anatomy/ it
    # imports types, for its annotations, and constants (a textbook formula's spelling), never a function.
    called = [f"{path.name}: {n.module}.{a.name}" for path in sorted(RENDER.glob("*.py"))
              for n in _runtime_imports(ast.parse(path.read_text()))
              if n.level == 2 and (n.module or "").split(".")[0] in ("analyse", "anatomy")
              for a in n.names if not a.name.isupper()]
    assert called == []


def test_a_class_named_estimate_is_not_taken_for_one():
    class Estimate:  # a user's own class of that name: the reconciliation once took it for memprof's
        trace = full_trace()
        ranks = ()

    with pytest.raises(InvalidArgumentError, match="estimate must be what memprof.estimate"):
        memprof.reconcile(full_trace(), estimate=Estimate())


def test_merge_takes_a_pipeline_estimate_by_type_not_by_name():
    class Estimate:  # looks like a pipeline's estimate to a check by name: one rank class holding a trace
        trace = full_trace()
        ranks = (type("RankClass", (), {"trace": full_trace()})(),)

    with pytest.raises(InvalidArgumentError, match="put it in a list"):
        memprof.merge(Estimate())


def test_a_view_not_registered_is_a_clear_error(monkeypatch):
    est = Estimate(trace=full_trace(), precision="fp32", device="cpu")
    monkeypatch.setattr(views, "_VIEWS", {})
    with pytest.raises(RegistryError, match="Estimate has no view 'to_text' registered"):
        str(est)


def test_a_view_registered_twice_is_refused():
    with pytest.raises(RegistryError, match="already registered"):
        views.register(Estimate, "to_text", lambda est: "")


def test_a_subclass_has_its_own_view_before_its_parents():
    t = full_trace()
    result = WhatIf(trace=t, precision="fp32", device="cpu", baseline=t.peak, baseline_peak_bytes=t.peak.total,
                    changes=(("precision", "bf16"),))
    assert str(result) == result.to_text() == what_if_text(result)
    assert dataclasses.replace(result, notes=("x",)).to_text() == what_if_text(dataclasses.replace(result, notes=("x",)))


def test_every_view_of_an_oom_report_lists_the_levers_the_facade_computed():
    # The levers are an analysis (analyse.reconciler.advice): the facade computes them once and hands them to the
    # text, the notebook view and the page alike, which all lead with what was live at the OOM.
    from memprof.record.parts import OomRecord
    from memprof.report.reports import levers

    t = dataclasses.replace(full_trace(), oom=OomRecord("OutOfMemoryError: CUDA out of memory (simulated)"),
                            live_at_error=full_trace().peak)
    found = levers(t)
    assert found  # the largest category at least
    report = memprof.Report(t)
    heads = [lever.split(":")[0] for lever in found[:4]]
    assert "Largest levers:" in report.to_text() and all(head in report.to_text() for head in heads)
    for markup in (report._repr_html_(), report.to_html()):
        assert "Largest levers:" in markup and all(html.escape(head) in markup for head in heads)
