"""pytest integration: the ``memory_profile`` fixture and the ``memory_budget`` marker.

Registered through the ``pytest11`` entry point, so installing torch-memprof
is enough::

    @pytest.mark.memory_budget(total="1.5 GiB", activations="600 MiB")
    def test_train_step(memory_profile):
        with memory_profile(model, optimizer) as prof:
            train_step()

After the test body, every report recorded through the fixture is judged
with :func:`memprof.check_budget`; an overrun, an unmeasured budget,
a bad size or a marked test that measured nothing fails the test.

Command-line options (group "memprof"):

``--memprof-save-dir DIR``
    write every recorded report as JSON (``memprof.load`` reads it back).
``--memprof-baseline DIR``
    compare each report's peak figures with the file of the same name in DIR
    and fail when any grew beyond ``--memprof-tolerance`` (default ``5%``).

This module imports nothing from torch at import time; memprof's own modules
are imported inside the hooks that need them.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import TYPE_CHECKING, Generator, Protocol
from urllib.parse import quote

import pytest


if TYPE_CHECKING:
    from .record.aliases import Forwarded
    from .report import Report
    from .report.estimates import Estimate
    from .report.profiling import Profiler

__all__ = ["MemoryProfileFixture", "BaselineMissingWarning", "reports", "report_file_names"]

MARKER = "memory_budget"
DEFAULT_TOLERANCE = "5%"

# What the fixture handed out or was given, in order: Profiler or Report objects.
_ENTRIES: "pytest.StashKey[list[Profiler | Report]]" = pytest.StashKey()
# The reports of a finished test (Profilers resolved to their Reports).
_REPORTS: "pytest.StashKey[list[Report]]" = pytest.StashKey()
# Paths written by --memprof-save-dir in this session (for the summary line).
_SAVED: "pytest.StashKey[list[str]]" = pytest.StashKey()
# id() of each estimated report -> the device kind ("cuda", "cpu") it was estimated for.
_ESTIMATED: "pytest.StashKey[dict[int, str]]" = pytest.StashKey()


class BaselineMissingWarning(UserWarning):
    """``--memprof-baseline`` has no file for a report; it was not compared."""


class MemoryProfileFixture:
    """What the ``memory_profile`` fixture gives a test.

    Call it like :func:`memprof.profile` (``with memory_profile(model,
    optimizer, mode="exact") as prof:``); every profile made through it is
    kept and, after the test body, judged against the test's
    ``memory_budget`` marker and the command-line options. :meth:`record`
    adds a report made elsewhere (for example with ``memprof.profile``
    directly, or loaded from a file).
    """

    def __init__(self, item: pytest.Item) -> None:
        self._item = item

    def __call__(self, model: object, optimizer: object = None, **kwargs: object) -> "Profiler":
        from .report.profiling import profile

        prof = profile(model, optimizer, **kwargs)
        self._item.stash.setdefault(_ENTRIES, []).append(prof)
        return prof

    def record(self, report: "Report") -> "Report":
        """Keep ``report`` with this test's reports (judged like the fixture's own)."""
        from .errors import InvalidArgumentError
        from .report import Report

        if not isinstance(report, Report):
            raise InvalidArgumentError(
                f"memory_profile.record() needs a memprof.Report, got {type(report).__name__}; "
                "pass prof.report()"
            )
        self._item.stash.setdefault(_ENTRIES, []).append(report)
        return report

    def estimate(self, model: object, optimizer: object = None, **kwargs: object) -> "Estimate":
        """Estimate the step with :func:`memprof.estimate` (same arguments) and keep its record with this
        test's reports. The device is the marker's ``estimate=`` (``"cuda"`` by default): a CPU-only CI
        then guards a GPU budget (``@pytest.mark.memory_budget(total="70 GiB", estimate="cuda")``).
        Returns the Estimate."""
        from .errors import InvalidArgumentError
        from .report.estimates import estimate

        wanted = _marker_budgets(self._item) or {}
        if wanted.get("estimate") not in (None, "cuda", "cpu"):
            raise InvalidArgumentError(
                f"@pytest.mark.{MARKER}: estimate must be 'cuda' or 'cpu' (the device the step is estimated "
                f"for), got {wanted['estimate']!r}")
        device = kwargs.pop("device", None) or wanted.get("estimate") or "cuda"
        kind = str(device).split(":")[0]  # "cuda:1" and torch.device("cuda") are a CUDA target too
        if wanted.get("estimate") not in (None, kind):
            raise InvalidArgumentError(
                f"memory_profile.estimate(device={device!r}) in a test whose budget is for estimate="
                f"{wanted['estimate']!r}; leave device= out, or change the marker")
        est = estimate(model, optimizer, device=device, **kwargs)
        report = est.report()
        self._item.stash.setdefault(_ENTRIES, []).append(report)
        self._item.stash.setdefault(_ESTIMATED, {})[id(report)] = kind
        return est

    @property
    def reports(self) -> "list[Report]":
        """Reports of the profiles that have finished so far, in creation order."""
        return _resolve(self._item.stash.get(_ENTRIES, []))

    def __repr__(self) -> str:
        return f"<memory_profile fixture of {self._item.nodeid}: {len(self._item.stash.get(_ENTRIES, []))} profile(s)>"


def reports(item: pytest.Item) -> "list[Report]":
    """The reports a test recorded through ``memory_profile`` (after its call phase, all of them).

    For use in ``conftest.py`` hooks, e.g. ``pytest_runtest_makereport``.
    """
    if _REPORTS in item.stash:
        return item.stash[_REPORTS].copy()
    return _resolve(item.stash.get(_ENTRIES, []))


def _resolve(entries: "list[Profiler | Report]") -> "list[Report]":
    from .errors import ProfilerStateError
    from .report import Report

    out = []
    for entry in entries:
        if isinstance(entry, Report):
            out.append(entry)
            continue
        try:
            out.append(entry.report())
        except ProfilerStateError as failure:
            if _is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            # Created but never entered (or still running): nothing to judge.
            continue
    return out


# -- options and marker -------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memprof", "memprof: memory budgets and baselines")
    group.addoption(
        "--memprof-save-dir",
        metavar="DIR",
        default=None,
        help="write every report recorded through the memory_profile fixture to DIR as JSON "
        "(file name from the test id; memprof.load() reads it).",
    )
    group.addoption(
        "--memprof-baseline",
        metavar="DIR",
        default=None,
        help="compare each recorded report's peak figures with the JSON of the same name in DIR "
        "(as written by --memprof-save-dir) and fail tests whose memory grew beyond --memprof-tolerance.",
    )
    group.addoption(
        "--memprof-tolerance",
        metavar="TOL",
        default=DEFAULT_TOLERANCE,
        help="relative growth allowed against --memprof-baseline: '5%%' or 0.05 (default %(default)s).",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(total=None, at='peak', estimate=None, **categories): fail the test when a report recorded "
        "through the memory_profile fixture exceeds these sizes ('1.5 GiB', '600 MB', bytes); with "
        "estimate='cuda', the step estimated by memory_profile.estimate(...) for that device; categories: "
        "weights, buffers, gradients, optimizer_states, activations, inputs, temporaries, "
        "allocator_overhead, outside_torch.",
    )
    config.stash[_SAVED] = []
    base = config.invocation_params.dir
    save_dir = config.getoption("memprof_save_dir", None)
    if save_dir is not None:
        if not save_dir.strip():
            raise pytest.UsageError("--memprof-save-dir is empty; give the folder to write reports to")
        path = base / save_dir
        if path.exists() and not path.is_dir():
            raise pytest.UsageError(
                f"--memprof-save-dir {save_dir}: this is a file, not a folder; give a folder (it is created "
                "if missing)"
            )
        config.option.memprof_save_dir = str(path)
    baseline = config.getoption("memprof_baseline", None)
    if baseline is not None:
        if not baseline.strip():
            raise pytest.UsageError("--memprof-baseline is empty; give the folder a run with --memprof-save-dir wrote")
        path = base / baseline
        if not path.is_dir():
            raise pytest.UsageError(
                f"--memprof-baseline {baseline}: no such directory; give the folder a run with "
                "--memprof-save-dir wrote"
            )
        config.option.memprof_baseline = str(path)
        if save_dir is not None and os.path.exists(config.option.memprof_save_dir) and os.path.samefile(
                config.option.memprof_save_dir, path):
            raise pytest.UsageError(
                f"--memprof-save-dir {save_dir} and --memprof-baseline {baseline} are one folder: every report "
                "would be saved over the baseline it is compared with, so growth would never be seen and the "
                "baseline would take the new figures; save to another folder, and copy it over the baseline "
                "once the run has passed"
            )
    if save_dir is not None:
        _prepare_save_dir(save_dir, config.option.memprof_save_dir)
    tolerance = config.getoption("memprof_tolerance", DEFAULT_TOLERANCE)
    if tolerance != DEFAULT_TOLERANCE:
        from .analyse.budget import parse_tolerance
        from .errors import MemprofError

        try:
            parse_tolerance(tolerance)
        except MemprofError as exc:
            if _is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            raise pytest.UsageError(f"--memprof-tolerance: {exc}") from None


def _prepare_save_dir(option: str, path: str) -> None:
    """Create the save folder and write in it once, at start-up: a folder that cannot be made (a file on
    the way, no permission, a read-only disk) is one usage error, not the same error in every test."""
    from .record.files import make_writable_folder

    try:
        make_writable_folder(path)
    except OSError as exc:
        if _is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise pytest.UsageError(
            f"--memprof-save-dir {option}: memprof cannot create or write this folder ({exc.strerror or exc}); "
            "give a folder it can write (it is created if missing)"
        ) from None


@pytest.fixture
def memory_profile(request: pytest.FixtureRequest) -> MemoryProfileFixture:
    """Profile like ``memprof.profile``; every report is kept and judged after the test.

    ``with memory_profile(model, optimizer, mode="exact") as prof: ...``
    """
    return MemoryProfileFixture(request.node)


# -- judging after the test body ------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> "Generator[None, object, object]":
    try:
        result = yield
    except BaseException:
        # The body failed (or skipped): keep what was measured, judge nothing,
        # and never mask the body's own exception.
        try:
            problems = _collect_and_save(item)[1]
        except Exception as exc:  # pragma: no cover - defensive
            if _is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            problems = [f"memprof could not save this test's reports: {exc!r}"]
        from .errors import MemprofWarning

        for problem in problems:
            try:
                warnings.warn(problem, MemprofWarning, stacklevel=1)
            except Warning as failed:
                if _is_interrupt(failed):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                pass  # warnings made errors (-W error): the body's own failure is what the test reports
        raise
    reports_, unsaved = _collect_and_save(item)
    failures = unsaved + _budget_failures(item, reports_) + _baseline_failures(item, reports_)
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
    return result


def _collect_and_save(item: pytest.Item) -> "tuple[list[Report], list[str]]":
    """The test's reports, each saved under --memprof-save-dir; and a line for each that could not be
    (a folder standing at its name, a full disk): the test fails with it rather than a traceback, as a
    report asked for and not written would later go uncompared."""
    entries = item.stash.get(_ENTRIES, [])
    reports_ = _resolve(entries)
    item.stash[_REPORTS] = reports_
    entries.clear()  # drop the Profilers; the reports are all that is kept
    save_dir = item.config.getoption("memprof_save_dir", None)
    unsaved: list[str] = []
    if save_dir and reports_:
        from .errors import MemprofError

        for name, rep in zip(report_file_names(item.nodeid, len(reports_)), reports_):
            path = os.path.join(save_dir, _with_rank(name, rep))
            try:
                os.makedirs(save_dir, exist_ok=True)  # again: something may have removed it since start-up
                rep.save(path)
            except (MemprofError, OSError) as exc:
                if _is_interrupt(exc):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                unsaved.append(f"memprof could not save this test's report to {path}: {exc}")
                continue
            item.config.stash.setdefault(_SAVED, []).append(path)
    return reports_, unsaved


def _marker_budgets(item: pytest.Item) -> "dict[str, Forwarded] | None":
    """The test's budgets, the closest marker winning per name; None when unmarked. (Checked where they are passed
    on: parse_budgets.)"""
    merged: "dict[str, Forwarded]" = {}
    found = False
    for mark in item.iter_markers(MARKER):
        found = True
        if mark.args:
            raise _MarkerError(
                f"@pytest.mark.{MARKER} takes keyword arguments only (total=..., activations=..., at=...), "
                f"got positional {mark.args!r}"
            )
        for key, value in mark.kwargs.items():
            merged.setdefault(key, value)
    return merged if found else None


class _MarkerError(Exception):
    pass


def _budget_failures(item: pytest.Item, reports_: "list[Report]") -> list[str]:
    try:
        budgets = _marker_budgets(item)
    except _MarkerError as exc:
        if _is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return [str(exc)]
    if budgets is None:
        return []
    from .analyse.budget import check_budget, parse_budgets
    from .errors import BudgetNotMeasured, MemoryBudgetExceeded, MemprofError
    from .vocabulary import BUDGET_MOMENTS

    at = budgets.pop("at", "peak")
    if at not in BUDGET_MOMENTS:
        return [f"@pytest.mark.{MARKER}: at must be 'peak' or 'end', got {at!r}"]
    estimate = budgets.pop("estimate", None)
    if estimate not in (None, "cuda", "cpu"):
        return [f"@pytest.mark.{MARKER}: estimate must be 'cuda' or 'cpu' (the device the step is estimated "
                f"for), got {estimate!r}"]
    if estimate is not None:
        estimated = item.stash.get(_ESTIMATED, {})
        real = [r for r in reports_ if id(r) not in estimated]
        if real or not reports_:
            return [f"@pytest.mark.{MARKER}(estimate={estimate!r}): the budget is for the step estimated for "
                    f"{estimate}; run it with memory_profile.estimate(model, optimizer, inputs=...) "
                    + ("instead of measuring it" if real else "(nothing was estimated)")]
    try:
        parse_budgets(**budgets)
    except MemprofError as exc:
        if _is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return [f"@pytest.mark.{MARKER}: {exc}"]
    if not reports_:
        return [
            f"@pytest.mark.{MARKER}: nothing was measured in this test, so its memory budget cannot be "
            "judged; profile the step with the memory_profile fixture: "
            "'with memory_profile(model, optimizer) as prof: ...'"
        ]
    failures = []
    for i, rep in enumerate(reports_):
        where = f" (profile {i + 1} of {len(reports_)})" if len(reports_) > 1 else ""
        try:
            check_budget(rep, at=at, **budgets)
        except MemoryBudgetExceeded as exc:
            if _is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            failures.append(f"MemoryBudgetExceeded{where}: {exc}")
        except BudgetNotMeasured as exc:
            if _is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            if rep.num_steps == 0:
                failures.append(
                    f"@pytest.mark.{MARKER}{where}: nothing was measured: the profile recorded no step; "
                    "run the step inside 'with memory_profile(model, optimizer) as prof:'"
                )
            else:
                failures.append(f"BudgetNotMeasured{where}: {exc}")
    return failures


def _baseline_failures(item: pytest.Item, reports_: "list[Report]") -> list[str]:
    baseline_dir = item.config.getoption("memprof_baseline", None)
    if not baseline_dir or not reports_:
        return []
    from .analyse.budget import compare_to_baseline, describe_growth
    from .errors import MemprofError
    from .report import load

    tolerance = item.config.getoption("memprof_tolerance", DEFAULT_TOLERANCE)
    failures = []
    for name, rep in zip(report_file_names(item.nodeid, len(reports_)), reports_):
        name = _with_rank(name, rep)
        path = os.path.join(baseline_dir, name)
        if not os.path.exists(path):
            warnings.warn(
                BaselineMissingWarning(
                    f"memprof: no baseline {name} in {baseline_dir}; this report was not compared "
                    "(write baselines with --memprof-save-dir)"
                ),
                stacklevel=1,
            )
            continue
        try:
            base = load(path)
        except MemprofError as exc:
            if _is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            failures.append(f"memprof baseline {path} cannot be read: {exc}")
            continue
        growths = compare_to_baseline(rep, base, tolerance)
        if growths:
            failures.append(f"MemoryGrewError against {path}: {describe_growth(growths, tolerance)}")
    return failures


# -- file names ---------------------------------------------------------------------

_MAX_STEM = 180


def _with_rank(name: str, rep: "Report") -> str:
    """A report of one rank of a torch.distributed run (pytest under torchrun: every rank runs the test) is
    ``<stem>@rank<N>.json``, so ranks neither overwrite each other nor compare against another's baseline.
    An encoded test id never holds ``@``."""
    return name if rep.rank is None else f"{name[:-len('.json')]}@rank{rep.rank}.json"


def report_file_names(nodeid: str, count: int) -> list[str]:
    """File names for a test's ``count`` reports: ``<stem>.json``, ``<stem>~2.json``, ...

    The stem is the test id percent-encoded (``urllib.parse.quote`` with only
    letters, digits, ``.``, ``_`` and ``-`` kept), so two ids never share a
    name and ``urllib.parse.unquote(stem)`` gives the id back:
    ``t.py::test[fp32/large]`` and ``t.py::test[fp32_large]`` stay apart. A
    stem over 180 characters is cut and given a hash of the full id (unique,
    no longer reversible). The first report never carries an index, so a test
    that later records a second profile keeps its first baseline; the index
    follows ``~``, which an encoded id never holds.
    """
    stem = quote(nodeid, safe="") or "test"
    stem = stem.replace("~", "%7E")  # quote keeps "~"; encode it, so "~" can mark a second report
    if stem.startswith("."):
        stem = "%2E" + stem[1:]  # no hidden files
    if len(stem) > _MAX_STEM:
        digest = hashlib.sha1(nodeid.encode("utf-8")).hexdigest()[:16]
        stem = f"{stem[:_MAX_STEM]}-{digest}"
    return [f"{stem}.json" if i == 0 else f"{stem}~{i + 1}.json" for i in range(count)]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Under pytest-xdist each worker writes its own reports; it hands their paths to the controller.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["memprof_saved"] = session.config.stash.get(_SAVED, []).copy()


class _WorkerNode(Protocol):
    """What this plugin reads of pytest-xdist's ``WorkerController`` (xdist is optional, so not imported): the
    controller's config (and ``workeroutput``, read by name: a worker that crashed has none)."""

    config: pytest.Config


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: _WorkerNode, error: object) -> None:
    """pytest-xdist: a worker finished; add the reports it wrote to the controller's summary."""
    saved = getattr(node, "workeroutput", {}).get("memprof_saved", [])
    node.config.stash.setdefault(_SAVED, []).extend(saved)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    saved = config.stash.get(_SAVED, [])
    if saved:
        folder = config.getoption("memprof_save_dir", None)
        terminalreporter.write_line(f"memprof: wrote {len(saved)} report(s) to {folder}")


def _is_interrupt(exc: BaseException) -> bool:
    # Imported here: the plugin module loads in every pytest run, without torch or memprof (see its docstring).
    from .errors import is_interrupt

    return is_interrupt(exc)
