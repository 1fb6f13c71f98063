"""Memory budgets: judge a measured run against limits per category.

``check_budget(report, total="1.5 GiB", activations="600 MiB")`` passes
quietly (returning what it judged) or raises :class:`~memprof.errors.MemoryBudgetExceeded`,
an ``AssertionError``, naming every overrun with exact bytes.

Budgets judge memprof's own accounting of what was created and categorised
inside the profile, never process-wide counters, so memory left behind by
earlier tests or freed late by the garbage collector does not move them. On
CPU in exact mode the figures are exact and repeatable to the byte.

A budget on a figure the run did not measure (``None`` in the breakdown, for
example temporaries in light mode on CPU) raises :class:`~memprof.errors.BudgetNotMeasured`:
an unjudgeable budget never passes.

This module imports neither torch nor pandas.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Iterator, Mapping, NamedTuple

from ..errors import is_interrupt
from ..vocabulary import BUDGET_MOMENTS, DEVICE_CATEGORIES, Category
from ..errors import (BudgetNotMeasured, InvalidArgumentError, MemoryBudgetExceeded, MemoryGrewError,
                      SizeParseError, UnknownNameError)
from ..record.trace import HoldsPeak, Trace
from ..units import format_bytes, parse_size, printable

if TYPE_CHECKING:
    from ..record.trace import Breakdown
    from .merge import Merged

__all__ = [
    "check_budget",
    "parse_budgets",
    "compare_to_baseline",
    "parse_tolerance",
    "describe_growth",
    "BudgetResult",
    "Judged",
    "Growth",
]

#: The budget name for the session's highest total (a computed figure, not a category).
TOTAL = "total"


class Judged(NamedTuple):
    """One budget and the figure it was judged against, both in bytes."""

    budget: int
    measured: int

    @property
    def headroom(self) -> int:
        """Bytes left under the budget (negative when over)."""
        return self.budget - self.measured


class BudgetResult(Mapping[str, Judged]):
    """What :func:`check_budget` judged: name -> :class:`Judged` (all within budget).

    Keys are ``"total"`` and category values (``"activations"``, ...), in
    the order the budgets were given. ``at`` says which breakdown the
    categories were judged on.
    """

    def __init__(self, judged: "Mapping[str, Judged]", at: str) -> None:
        self._judged = dict(judged)
        self.at = at

    def __getitem__(self, key: "str | Category") -> Judged:
        if isinstance(key, Category):
            key = key.value
        return self._judged[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._judged)

    def __len__(self) -> int:
        return len(self._judged)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}: {v.measured} <= {v.budget}" for k, v in self._judged.items())
        return f"<BudgetResult at={self.at} {{{inner}}}>"


class Growth(NamedTuple):
    """One figure that grew against its baseline: name, baseline bytes, measured bytes."""

    name: str
    baseline: int
    measured: int

    @property
    def delta(self) -> int:
        return self.measured - self.baseline

    def describe(self) -> str:
        if self.baseline:
            pct = f"+{100 * self.delta / self.baseline:.1f}%"
        else:
            pct = "from nothing"
        return f"{self.name}: {_exact(self.baseline)} -> {_exact(self.measured)}, +{_exact(self.delta)} ({pct})"


def _budget_bytes(name: str, value: "int | float | str") -> int:
    """parse_size, with the budget's name in the error message."""
    try:
        return parse_size(value)
    except SizeParseError as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise SizeParseError(f"budget {name}={value!r}: {exc}") from None


def _names_known() -> str:
    return ", ".join([TOTAL] + [c.value for c in Category])


def parse_budgets(total: "int | str | None" = None, **categories: "int | str") -> dict[str, int]:
    """Validate budgets without a report: name (``"total"`` or a category value) -> bytes.

    Raises what :func:`check_budget` raises for bad input: ``UnknownNameError``,
    ``SizeParseError`` (quoting the value), ``InvalidArgumentError`` when empty.
    """
    budgets: dict[str, int] = {}
    if total is not None:
        budgets[TOTAL] = _budget_bytes(TOTAL, total)
    for name, value in categories.items():
        try:
            cat = Category.parse(name)
        except UnknownNameError as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            raise UnknownNameError(
                f"unknown budget name {name!r}; use one of: {_names_known()}"
            ) from None
        budgets[cat.value] = _budget_bytes(cat.value, value)
    if not budgets:
        raise InvalidArgumentError(
            f"no budget was given; name at least one, e.g. total='1 GiB' (names: {_names_known()})"
        )
    return budgets


def _measured(trace: Trace, budgets: "dict[str, int]", at: str) -> "dict[str, int]":
    """The figure each budget judges (the session's highest total for ``total``, a category at the peak or the
    end); BudgetNotMeasured naming the figures the run did not measure, and how to measure them."""
    breakdown = trace.peak if at == "peak" else trace.end
    measured = {name: trace.peak.total if name == TOTAL else breakdown[name] for name in budgets}
    unmeasured = tuple(n for n, v in measured.items() if v is None)
    if unmeasured:
        what = ", ".join(_label(n, at) for n in unmeasured)
        device_only = {c.value for c in DEVICE_CATEGORIES}
        if all(n in device_only for n in unmeasured):
            fix = "those figures exist only on an accelerator (CUDA); drop the budget where none is used"
        else:
            fix = "profile with mode='exact' (exact on any device) or drop that budget"
        raise BudgetNotMeasured(
            f"memory budget cannot be judged: {what} not measured in this run "
            f"(mode {trace.mode}, device {trace.device.type}); "
            f"a budget on an unmeasured figure never passes: {fix}",
            unmeasured,
        )
    return {n: v for n, v in measured.items() if v is not None}


def check_budget(report: object, total: "int | str | None" = None, *, at: str = "peak",
                 **categories: "int | str") -> BudgetResult:
    """Judge ``report`` (a :class:`memprof.Report`) against memory budgets; raise if any is exceeded.

    ``total`` limits the session's highest total (``report.peak.total``,
    whatever ``at`` says). Keyword arguments named after categories
    (``activations="600 MiB"``, ``optimizer_states=4096``) limit that
    category in the breakdown at the session's peak (``at="peak"``, the
    default) or when profiling ended (``at="end"``). Sizes are ints of bytes
    or strings with IEC (KiB, MiB, GiB: powers of 1024) or SI (kB, MB, GB:
    powers of 1000) units; ``0`` means nothing of that category may exist.
    A figure passes when it is at most its budget (equal passes).

    Returns a :class:`BudgetResult` (name -> ``(budget, measured)``) when
    every budget holds. Raises :class:`~memprof.errors.MemoryBudgetExceeded` (an
    ``AssertionError``) naming each overrun, its budget, the measured figure
    and the excess, followed by the breakdown at the peak (and at the end with ``at="end"``);
    :class:`~memprof.errors.BudgetNotMeasured` when a budget names a figure the run did not
    measure or the profile recorded no step; ``UnknownNameError`` for a name
    that is neither ``total`` nor a category; ``SizeParseError`` for a size
    that is negative, NaN, infinite, a bool or unparseable.

    ``report`` may also be a :class:`~memprof.Merged` (the ranks of one distributed run): every rank is
    judged, the error names each rank over budget, and the result is the worst rank's.
    """
    from .merge import Merged

    if isinstance(report, Merged):
        return _check_ranks(report, total, at, categories)
    trace = getattr(report, "trace", None)
    if not isinstance(trace, Trace):
        raise InvalidArgumentError(
            f"check_budget() needs a memprof.Report, got {type(report).__name__}; "
            "pass prof.report() or memprof.load(path)"
        )
    if at not in BUDGET_MOMENTS:
        raise InvalidArgumentError(f"at must be 'peak' or 'end', got {at!r}")

    budgets = parse_budgets(total, **categories)

    if trace.num_steps == 0:
        raise BudgetNotMeasured(
            "the profile recorded no step, so nothing was measured and the budget cannot be judged; "
            "run the training (or inference) step inside 'with memprof.profile(...)'",
            tuple(budgets),
        )

    judged = {n: Judged(budgets[n], m) for n, m in _measured(trace, budgets, at).items()}
    over = {n: j for n, j in judged.items() if j.measured > j.budget}
    if over:
        lines = [f"memory budget exceeded ({len(over)} of {len(judged)} budget(s)):"]
        for n, j in over.items():
            excess = j.measured - j.budget
            lines.append(
                f"  {_label(n, at)}: measured {_exact(j.measured)} > budget {_exact(j.budget)}, "
                f"over by {_exact(excess)}"
            )
        lines.append("")
        lines.extend(_table(trace, at))
        raise MemoryBudgetExceeded("\n".join(lines), over)
    return BudgetResult(judged, at)


def _exact(n: int) -> str:
    """``"1.5 KiB (1536 B)"``; just ``"360 B"`` when that is already exact."""
    text = format_bytes(n)
    return text if abs(n) < 1024 else f"{text} ({n} B)"


def _label(name: str, at: str) -> str:
    if name == TOTAL:
        return "peak total"
    return f"{name} at {'the peak' if at == 'peak' else 'the end'}"


def _table(trace: Trace, at: str) -> list[str]:
    """The breakdown(s) the budgets were judged on, one line per category."""
    blocks = [("peak", trace.peak)]
    if at == "end":
        blocks.append(("end", trace.end))
    lines: list[str] = []
    for title, bd in blocks:
        if lines:
            lines.append("")
        lines.append(f"Breakdown at the {title} ({trace.mode} mode, {trace.device.type}):")
        lines.extend(_rows(bd))
    return lines


def _rows(bd: "Breakdown") -> list[str]:
    rows = []
    for cat in Category:
        v = bd[cat]
        rows.append(f"  {cat.value:<20}{format_bytes(v):>14}{'' if v is None else f'{v:>14} B'}")
    total = bd.total
    rows.append(f"  {'total':<20}{format_bytes(total):>14}{'' if total is None else f'{total:>14} B'}")
    return rows


# -- baselines -------------------------------------------------------------------


def parse_tolerance(value: "str | float | int | Fraction") -> Fraction:
    """Parse a relative tolerance: ``"5%"``, ``0.05`` and ``"0.05"`` all mean five percent.

    Returned as an exact :class:`~fractions.Fraction`. Negative, NaN,
    infinite or boolean values raise :class:`~memprof.errors.InvalidArgumentError`.
    """
    if isinstance(value, bool):
        raise InvalidArgumentError(f"tolerance {value!r} is a boolean; give a fraction like 0.05 or '5%'")
    try:
        if isinstance(value, Fraction):
            frac = value
        elif isinstance(value, (int, float)):
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError
            frac = Fraction(str(value))
        elif isinstance(value, str):
            text = value.strip()
            if text.endswith("%"):
                frac = Fraction(text[:-1].strip()) / 100
            else:
                frac = Fraction(text)
        else:
            raise InvalidArgumentError(
                f"tolerance {value!r} has type {type(value).__name__}; give a fraction like 0.05 or '5%'"
            )
    except (ValueError, ZeroDivisionError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise InvalidArgumentError(
            f"cannot parse tolerance {value!r}; write a fraction such as 0.05 or a percentage such as '5%'"
        ) from None
    if frac < 0:
        raise InvalidArgumentError(f"tolerance {value!r} is negative; give 0 or more (0.05 or '5%')")
    return frac


def compare_to_baseline(report: HoldsPeak, baseline: HoldsPeak, tolerance: "str | float | Fraction" = "5%",
                        *, raise_on_growth: bool = False) -> tuple[Growth, ...]:
    """The peak figures of ``report`` that grew beyond ``tolerance`` over ``baseline`` (Reports or Traces).

    Compares the peak total and every category of the peak breakdown.
    A figure grows too much when ``measured > baseline * (1 + tolerance)``,
    computed exactly; from a baseline of 0 any growth counts. Figures that
    either report did not measure are skipped. With ``raise_on_growth``,
    raises :class:`~memprof.errors.MemoryGrewError` listing the growths instead of returning them.
    """
    tol = parse_tolerance(tolerance)
    pairs: list[tuple[str, "int | None", "int | None"]] = [("peak total", baseline.peak.total, report.peak.total)]
    pairs += [(c.value, baseline.peak[c], report.peak[c]) for c in Category]
    growths = tuple(
        Growth(name, int(old), int(new))
        for name, old, new in pairs
        if old is not None and new is not None and new > old and Fraction(new) > Fraction(old) * (1 + tol)
    )
    if growths and raise_on_growth:
        raise MemoryGrewError(describe_growth(growths, tol), growths)
    return growths


def describe_growth(growths: "tuple[Growth, ...]", tolerance: "str | float | Fraction") -> str:
    """The message listing what grew beyond the tolerance."""
    tol = parse_tolerance(tolerance)
    lines = [f"memory grew beyond the {_pct(tol)} tolerance against the baseline:"]
    lines += [f"  {g.describe()}" for g in growths]
    return printable("\n".join(lines))


def _pct(frac: Fraction) -> str:
    value = float(frac * 100)
    return f"{value:g}%"


def _check_ranks(merged: "Merged", total: "int | str | None", at: str,
                 categories: dict[str, int | str]) -> BudgetResult:
    """Each rank against the budgets: one error naming every rank over them, or the worst rank's result."""
    results: dict[int, BudgetResult] = {}
    failed: list[tuple[int, MemoryBudgetExceeded]] = []
    for rank, rep in merged.ranks.items():
        try:
            results[rank] = check_budget(rep, total, at=at, **categories)
        except MemoryBudgetExceeded as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            failed.append((rank, exc))
    if failed:
        first = str(failed[0][1]).splitlines()[0]
        ranks = ", ".join(str(r) for r, _ in failed)
        raise MemoryBudgetExceeded(f"rank(s) {ranks} of {merged.world_size} over budget; rank {failed[0][0]}: {first}",
                                   failed[0][1].overruns)
    return results[merged.worst]
