"""The ranks of one distributed run side by side: ``memprof.merge(reports_or_paths)``.

Each rank profiles itself and saves its report (``memprof-rank{r}.json`` from the integrations, or
``report.save(f"rank{rank}.json")``). :func:`merge` reads them back, checks that they are the ranks of
one run, and answers the questions people ask of a job: which rank peaks highest, by how much the ranks
differ, and what each held at its peak. Simulated ranks merge the same way: an estimate of a pipeline, which
holds every rank class, or a list of estimates of single ranks (``estimate(..., parallelize=fn, rank=r)``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable, Iterable, Protocol, TypeVar, cast

from ..errors import InvalidArgumentError, MergeError, is_interrupt
from ..record.estimate import Estimate
from ..record.files import load_trace
from ..record.parts import RankInfo
from ..record.aliases import JSONObject
from ..record.trace import HoldsPeak, Trace, TraceSource, as_trace
from ..record.views import show
from ..vocabulary import Category

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Merged", "merge"]

H = TypeVar("H", bound=Hashable)


class RankClassLike(Protocol):
    """A class of simulated ranks: a :class:`memprof.simulate.pipeline.RankClass`, named by what it has."""

    @property
    def ranks(self) -> tuple[int, ...]: ...
    @property
    def representative(self) -> int: ...
    @property
    def stages(self) -> tuple[int, ...]: ...
    @property
    def peak_bytes(self) -> int: ...
    @property
    def peak_step(self) -> "int | None": ...
    @property
    def peak_phase(self) -> str: ...
    @property
    def trace(self) -> "Trace | None": ...


@dataclass(frozen=True)
class Merged:
    """The ranks of one run. ``ranks`` maps each rank to its :class:`~memprof.record.trace.Trace`
    (:func:`memprof.merge`'s: to its :class:`~memprof.Report`); ``missing`` lists ranks of the world that were
    not given; ``notes`` say what else to know. Its text, table and HTML are views registered by the facade
    (:mod:`memprof.record.views`)."""

    ranks: "dict[int, HoldsPeak]"  # each rank's Trace, or its Report (a layer above)
    world_size: int
    missing: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    #: Simulated ranks: the classes of ranks that hold the same memory
    #: (:class:`memprof.simulate.pipeline.RankClass`: its ranks, the one simulated, its pipeline stages and peak);
    #: ``ranks`` then holds each class's simulated rank. Empty for measured ranks, each of which is its own.
    classes: "tuple[RankClassLike, ...]" = ()

    @property
    def simulated(self) -> bool:
        """Is any of these ranks simulated (torch's fake process group, or memprof's layout simulation) rather
        than measured? (Both, only where ``merge(..., mixed=True)`` asked for it: the notes say which.)"""
        return any(_simulated(as_trace(t).distributed) for t in self.ranks.values())

    def to_dict(self) -> JSONObject:
        """The merge as plain JSON data: the world, the worst rank, the spread, each rank's peak and composition
        there (``null`` where not measured), the rank classes and the notes."""
        spread = self.spread
        return {"world_size": self.world_size, "simulated": self.simulated, "worst": self.worst,
                "spread": None if spread is None else {"bytes": spread[0], "max_over_mean": spread[1]},
                "missing": list(self.missing), "notes": list(self.notes),
                "ranks": {str(r): _rank_dict(as_trace(t)) for r, t in self.ranks.items()},
                "classes": [{"ranks": list(c.ranks), "simulated_rank": c.representative, "stages": list(c.stages),
                             "peak": c.peak_bytes, "peak_step": c.peak_step, "peak_phase": c.peak_phase}
                            for c in self.classes]}

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
        if self.classes:  # each simulated rank stands for its class: the mean is over every rank of the world
            sizes = {c.representative: len(c.ranks) for c in self.classes}
            weight = [sizes.get(r, 1) for r in self.ranks]
            mean = sum(w * (t.peak.total or 0) for w, t in zip(weight, self.ranks.values())) / sum(weight)
        return max(known) - min(known), (max(known) / mean if mean else 1.0)

    def to_frame(self) -> "pd.DataFrame":
        """One row per rank: the peak total, the step and phase of the peak, and each category at the peak."""
        return show(self, "to_frame")

    def to_text(self) -> str:
        """Each rank's peak, where it was and its largest categories, and the spread: what ``print()`` shows."""
        text: str = show(self, "to_text")
        return text

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        html: str = show(self, "_repr_html_")
        return html


def merge(reports: "Iterable[TraceSource] | Estimate", *, mixed: bool = False) -> Merged:
    """Put the reports of the ranks of one run side by side.

    ``reports`` is a list (any iterable) of :class:`~memprof.Report` objects (anything holding a Trace as
    ``.trace``), Traces or paths of saved traces, one per rank; or simulated ranks: an
    :class:`~memprof.Estimate` of a pipeline (``estimate(..., pipeline=...)`` without ``rank=``, which holds every
    rank class), or a list of estimates of single ranks (``estimate(..., parallelize=fn, rank=r)``), whose
    ``classes`` then say which ranks each simulated rank stands for. Each must come from a
    profile inside a torch.distributed process group (its trace records its rank); together they must
    be distinct ranks of one run: one world size, one parallel layout over one backend and one device
    mesh, one model (same parameter count, but for pipeline stages). Simulated ranks are not put beside
    measured ones unless ``mixed=True`` says that is meant (a prediction held against a run): they must then
    share the world size and the mesh, and a note names what else differs. Ranks of the world that are
    missing are listed in ``missing`` and in the notes, not refused: a job's surviving ranks are worth
    reading. Raises :class:`~memprof.errors.MergeError` otherwise.
    """
    if not isinstance(mixed, bool):
        raise InvalidArgumentError(f"merge(mixed=...) must be True or False, got {mixed!r}")
    items, classes = _expand(_items(reports))
    given = [_trace(r) for r in items]
    names = [os.fspath(r) if isinstance(r, (str, os.PathLike)) else f"report {i}" for i, r in enumerate(items)]
    if not given:
        raise MergeError("merge() needs at least one report (one per rank)")
    ranks: dict[int, Trace] = {}
    files: dict[int, str] = {}  # the file each rank was read from, where it was
    for item, name, trace in zip(items, names, given):
        info = trace.distributed
        if info is None:
            raise MergeError(f"{name} was not profiled inside a torch.distributed process group (its trace "
                             "records no rank); profile each rank after init_process_group")
        if info.rank in ranks:
            raise MergeError(f"rank {info.rank} is given twice ({name} is one); give each rank's report once")
        ranks[info.rank] = trace
        if isinstance(item, (str, os.PathLike)):
            files[info.rank] = name
    world, notes = _one_run({r: t.distributed for r, t in ranks.items() if t.distributed is not None}, files, mixed)
    staged = any(c.stages for c in classes) or any(
        t.distributed is not None and t.distributed.layout_detail is not None
        and t.distributed.layout_detail.degree("pp") > 1 for t in given)
    params = {t.facts.num_params for t in given}
    if len(params) > 1 and not staged:  # pipeline stages hold different layers: their counts differ by design
        raise MergeError(f"the reports profile models of different sizes ({sorted(params)} parameters on the rank): "
                         "not the ranks of one run")
    outside = sorted(r for r in ranks if r >= world)
    if outside:
        raise MergeError(f"rank(s) {outside} do not exist in a world of {world}")
    covered = {r for c in classes for r in c.ranks}  # ranks a simulated rank stands for
    missing = tuple(r for r in range(world) if r not in ranks and r not in covered)
    if missing:
        notes.insert(0, f"ranks {_spans(missing)} of {world} were not given")
    if classes:
        notes.append(f"simulated: {len(classes)} rank class(es) stand for {len(covered | set(ranks)):,} of {world:,} "
                     "ranks; each class's ranks hold the same memory, its first rank was simulated")
    if any(r.peak.total is None for r in ranks.values()):
        notes.append("a rank's peak total was not measured (light mode on CPU): the worst rank and the spread "
                     "compare what was measured only")
    return Merged(ranks=dict(sorted(ranks.items())), world_size=world, missing=missing, notes=tuple(notes),
                  classes=tuple(sorted(classes, key=lambda c: c.representative)))


def _simulated(info: "RankInfo | None") -> bool:
    """A simulated rank's record: torch's fake process group ran it (``"fake"``), or memprof's own layout
    simulation (no backend at all: a measured rank always records its process group's)."""
    return info is not None and (info.backend is None or info.backend == "fake")


def _one_run(infos: "dict[int, RankInfo]", files: "dict[int, str]", mixed: bool) -> "tuple[int, list[str]]":
    """Refuse ranks that cannot be of one run, naming them (and the files they were read from) and what differs:
    the world size; the parallel layout, the backend and the device mesh among measured ranks, and among
    simulated ones; simulated beside measured ranks unless ``mixed``, and then a mesh of their own. The world
    size, and the notes a mixed merge needs."""
    labels = {r: f"rank {r}" + (f" ({files[r]})" if r in files else "") for r in infos}
    _same(labels, {r: i.world_size for r, i in infos.items()}, "world sizes", lambda w: f"of a world of {w}")
    world = next(iter(infos.values())).world_size
    simulated = {r for r, i in infos.items() if _simulated(i)}
    measured = set(infos) - simulated
    if simulated and measured and not mixed:
        raise MergeError(f"{_listed(labels, sorted(simulated))} simulated and {_listed(labels, sorted(measured))} "
                         "measured: merge the ranks of one run, or pass mixed=True to hold a prediction against "
                         "a run")
    for group, how in ((measured, "measured"), (simulated, "simulated")):
        _same(labels, {r: (infos[r].layout, infos[r].backend, _mesh(infos[r])) for r in group},
              f"parallel layouts ({how} ranks)", _layout_words)
    _same(labels, {r: _mesh(i) for r, i in infos.items()}, "device meshes", _mesh_words)
    if not (simulated and measured):
        return world, []
    layouts = {infos[r].layout for r in infos}
    notes = [f"mixed: {_listed(labels, sorted(simulated))} simulated, {_listed(labels, sorted(measured))} measured"]
    if len(layouts) > 1:
        notes.append("the simulated and measured ranks name their layouts differently (" + " and ".join(
            sorted(str(lay or "unwrapped") for lay in layouts)) + ") over one mesh: check they are one layout")
    return world, notes


def _mesh(info: RankInfo) -> "tuple[tuple[str, int], ...] | None":
    return info.layout_detail.mesh if info.layout_detail is not None else None


def _layout_words(key: "tuple[str | None, str | None, tuple[tuple[str, int], ...] | None]") -> str:
    """(layout, backend, mesh) in words: ``fsdp2 over nccl on mesh dp_shard=4``, ``ddp over gloo``."""
    layout, backend, mesh = key
    words = [str(layout or "unwrapped")] + ([f"over {backend}"] if backend is not None else [])
    return " ".join(words + ([_mesh_words(mesh)] if mesh else []))


def _mesh_words(mesh: "tuple[tuple[str, int], ...] | None") -> str:
    return "on mesh " + " x ".join(f"{n}={s}" for n, s in mesh) if mesh else "on no device mesh"


def _same(labels: "dict[int, str]", values: "dict[int, H]", what: str, words: "Callable[[H], str]") -> None:
    """Refuse ranks whose ``values`` differ, naming each value and the ranks that hold it."""
    held: dict[H, list[int]] = {}
    for r in sorted(values):
        held.setdefault(values[r], []).append(r)
    if len(held) > 1:
        raise MergeError(f"the ranks have different {what}: " + "; ".join(
            f"{_listed(labels, rs)} {words(v)}" for v, rs in held.items()) + ": not the ranks of one run")


def _listed(labels: "dict[int, str]", ranks: "list[int]") -> str:
    """Ranks as a merge message names them, with a verb: in stretches (``ranks 0-3 are``), or with the files
    they were read from (the first few, then a count)."""
    if len(ranks) == 1:
        return f"{labels[ranks[0]]} is"
    if all(labels[r] == f"rank {r}" for r in ranks):
        return f"ranks {_spans(tuple(ranks))} are"
    more = f" and {len(ranks) - 4} more" if len(ranks) > 4 else ""
    return ", ".join(labels[r] for r in ranks[:4]) + more + " are"


def _expand(items: "list[object]") -> "tuple[list[object], list[RankClassLike]]":
    """Estimates of a pipeline (``.ranks``: every rank class, each with its simulated Trace) in place of the
    classes' traces; a plain estimate of one rank stands for that rank alone (a class of one)."""
    out: list[object] = []
    classes: list[RankClassLike] = []
    for item in items:
        held = getattr(item, "ranks", None)
        if not isinstance(item, Estimate) or not isinstance(held, tuple):
            out.append(item)
            continue
        if not held:  # one simulated rank: itself alone, as a measured rank is
            out.append(item)
            continue
        for c in held:
            if c.trace is None:
                raise MergeError("this estimate's rank classes carry no traces (an estimate from an older memprof): "
                                 "estimate again to merge its ranks")
            out.append(c.trace)
            classes.append(c)
    return out, classes


def _rank_dict(t: Trace) -> JSONObject:
    return {"peak": t.peak.total, "peak_step": t.peak_step,
            "peak_phase": t.peak_phase.value if t.peak_phase is not None else None,
            "at_peak": {c.value: t.peak[c] for c in Category}}


_TAKES = "merge() takes a list of reports or paths of saved traces (Traces too), one per rank"


def _items(reports: object) -> list[object]:
    """The ranks' reports as a list: one report, one path or anything that is not a list is refused."""
    if isinstance(reports, Estimate) and bool(reports.ranks):
        return [reports]  # a pipeline's estimate: every rank class it simulated
    if isinstance(reports, (str, bytes, os.PathLike, Trace, dict)) or hasattr(reports, "trace"):
        raise InvalidArgumentError(f"{_TAKES}; got one {type(reports).__name__}: put it in a list")
    try:
        return list(cast("Iterable[object]", reports))  # no iterable: its TypeError, caught below
    except TypeError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise InvalidArgumentError(f"{_TAKES}, got {type(reports).__name__}") from None


def _trace(item: object) -> Trace:
    if isinstance(item, (str, os.PathLike)):
        return load_trace(item)
    try:
        return as_trace(item)
    except InvalidArgumentError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
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
