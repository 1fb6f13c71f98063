"""The ranks of one distributed run side by side: ``memprof.merge(reports_or_paths)``.

Each rank profiles itself and saves its report (``memprof-rank{r}.json`` from the integrations, or
``report.save(f"rank{rank}.json")``). :func:`merge` reads them back, checks that they are the ranks of
one run, and answers the questions people ask of a job: which rank peaks highest, by how much the ranks
differ, and what each held at its peak.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

from ..errors import InvalidArgumentError, MergeError
from ..record.files import load_trace
from ..record.trace import Trace, as_trace

__all__ = ["Merged", "merge"]


@dataclass(frozen=True)
class Merged:
    """The ranks of one run. ``ranks`` maps each rank to its :class:`~memprof.record.trace.Trace`
    (:class:`memprof.Merged`: to its Report); ``missing`` lists ranks of the world that were not given;
    ``notes`` say what else to know. Plain data: :class:`memprof.Merged` adds its text, table and HTML."""

    ranks: "dict[int, Any]"
    world_size: int
    missing: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def worst(self) -> int:
        """The rank with the largest peak (the lowest such rank on a tie; peaks not measured count last)."""
        return max(sorted(self.ranks), key=lambda r: (self.ranks[r].peak.total is not None,
                                                      self.ranks[r].peak.total or 0, -r))

    @property
    def spread(self) -> "tuple[int, float] | None":
        """(max - min, max / mean) of the ranks' peak totals; None when a rank's total was not measured."""
        peaks = [r.peak.total for r in self.ranks.values()]
        if any(p is None for p in peaks) or not peaks:
            return None
        known = [p for p in peaks if p is not None]
        mean = sum(known) / len(known)
        return max(known) - min(known), (max(known) / mean if mean else 1.0)


def merge(reports: Iterable["Trace | Any | str | os.PathLike[str]"]) -> Merged:
    """Put the reports of the ranks of one run side by side.

    ``reports`` is a list (any iterable) of :class:`~memprof.Report` objects (anything holding a Trace as
    ``.trace``), Traces or paths of saved traces, one per rank. Each must come from a
    profile inside a torch.distributed process group (its trace records its rank); together they must
    be distinct ranks of one world size and one model (same parameter count). Ranks of the world that
    are missing are listed in ``missing`` and in the notes, not refused: a job's surviving ranks are
    worth reading. Raises :class:`~memprof.errors.MergeError` otherwise.
    """
    items = _items(reports)
    given = [_trace(r) for r in items]
    names = [os.fspath(r) if isinstance(r, (str, os.PathLike)) else f"report {i}" for i, r in enumerate(items)]
    if not given:
        raise MergeError("merge() needs at least one report (one per rank)")
    ranks: dict[int, Trace] = {}
    worlds: set[int] = set()
    params: set[int] = set()
    layouts: set[tuple[Any, Any]] = set()
    for name, trace in zip(names, given):
        info = trace.distributed
        if info is None:
            raise MergeError(f"{name} was not profiled inside a torch.distributed process group (its trace "
                             "records no rank); profile each rank after init_process_group")
        if info.rank in ranks:
            raise MergeError(f"rank {info.rank} is given twice ({name} is one); give each rank's report once")
        layouts.add((info.layout, info.backend))
        ranks[info.rank] = trace
        worlds.add(info.world_size)
        params.add(trace.facts.num_params)
    if len(worlds) > 1:
        raise MergeError(f"the reports come from runs of different world sizes ({sorted(worlds)}): not one run")
    world = worlds.pop()
    if len(params) > 1:
        raise MergeError(f"the reports profile models of different sizes ({sorted(params)} parameters on the rank): "
                         "not the ranks of one run")
    outside = sorted(r for r in ranks if r >= world)
    if outside:
        raise MergeError(f"rank(s) {outside} do not exist in a world of {world}")
    missing = tuple(r for r in range(world) if r not in ranks)
    notes = [f"ranks {_spans(missing)} of {world} were not given"] if missing else []
    if len(layouts) > 1:
        notes.append("the ranks report different layouts or backends (" + "; ".join(
            f"{lay or 'unwrapped'} over {be}" for lay, be in sorted(layouts, key=str)) + "): check they are one run")
    if any(r.peak.total is None for r in ranks.values()):
        notes.append("a rank's peak total was not measured (light mode on CPU): the worst rank and the spread "
                     "compare what was measured only")
    return Merged(ranks=dict(sorted(ranks.items())), world_size=world, missing=missing, notes=tuple(notes))


_TAKES = "merge() takes a list of reports or paths of saved traces (Traces too), one per rank"


def _items(reports: Any) -> list[Any]:
    """The ranks' reports as a list: one report, one path or anything that is not a list is refused."""
    if isinstance(reports, (str, bytes, os.PathLike, Trace, dict)) or hasattr(reports, "trace"):
        raise InvalidArgumentError(f"{_TAKES}; got one {type(reports).__name__}: put it in a list")
    try:
        return list(reports)
    except TypeError:
        raise InvalidArgumentError(f"{_TAKES}, got {type(reports).__name__}") from None


def _trace(item: Any) -> Trace:
    if isinstance(item, (str, os.PathLike)):
        return load_trace(item)
    try:
        return as_trace(item)
    except InvalidArgumentError:
        raise InvalidArgumentError(f"{_TAKES}, got {type(item).__name__} in the list") from None


#: Stretches of missing ranks a note names before it counts the rest.
_MAX_SPANS = 12


def _spans(ranks: tuple[int, ...]) -> str:
    """Ranks in increasing order as stretches ("1-3, 7"), the first :data:`_MAX_SPANS` of them: a world
    of a million ranks with one given is one short line."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    shown = ", ".join(f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in spans[:_MAX_SPANS])
    rest = len(spans) - _MAX_SPANS
    return shown + (f" and {sum(b - a + 1 for a, b in spans[_MAX_SPANS:])} more" if rest > 0 else "")
