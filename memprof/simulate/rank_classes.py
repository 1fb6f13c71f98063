"""A pipeline's rank classes: the ranks of one ``pp`` coordinate hold the same memory, so one representative each
is simulated and the worst one's estimate is the pipeline's, listing them all (:func:`pipeline_ranks`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Protocol, cast

from ..errors import InvalidArgumentError
from ..vocabulary import Phase
from .parallel import check_mesh, coordinates
from .pipeline import RankClass

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparison

    from ..record.estimate import Estimate
    from .pipeline import Pipeline
    from .run import MeshSizes

__all__ = ["pipeline_ranks", "worst_stage", "Over"]


class Over(Protocol):
    """What a search that asks only whether a batch fits tells :func:`pipeline_ranks`: the rank class to simulate
    first (its index along ``pp``), and whether an estimate is over what fits (then no other class is needed)."""

    @property
    def first(self) -> int: ...

    def exceeds(self, est: "Estimate") -> bool: ...


def pipeline_ranks(world_size: int, mesh: "MeshSizes | None", pipeline: "Pipeline", one: "Callable[[int], Estimate]",
                   key: "Callable[[Estimate], SupportsRichComparison] | None" = None,
                   many: "Callable[[list[int]], list[Estimate]] | None" = None,
                   over: "Over | None" = None) -> "Estimate":
    """Every pipeline rank class simulated (one per ``pp`` coordinate, its representative the rank with 0 on every
    other dimension: they hold the same shards), and the worst one's estimate, listing them all. The worst is the
    one with the largest tensors' peak, or the largest ``key(estimate)`` (a plan's: the device-level peak).
    ``many`` simulates the representatives given, in their order, where ``one`` each in turn would (in forked
    processes: :func:`memprof.simulate.stages.simulate`).

    With ``over`` (a plan's search, which asks only whether the batch fits), the classes are simulated one at a
    time, ``over.first`` first, and the others are not once one is over (``over.exceeds``): the batch does not
    fit whatever they hold. The estimate is then the worst of those simulated, and its note names the others as
    not simulated."""
    shape, names = check_mesh(mesh if mesh is not None else {"pp": world_size}, world_size)
    if not names or "pp" not in names:
        raise InvalidArgumentError(f"a pipeline needs a mesh dimension named 'pp'; got {mesh!r}")
    d = names.index("pp")
    every = [tuple(r for r in range(world_size) if coordinates(r, shape)[d] == p) for p in range(shape[d])]
    representatives = [members[0] for members in every]
    if over is None:
        estimates: "list[Estimate | None]" = list(many(representatives) if many is not None
                                                  else [one(r) for r in representatives])
    else:
        estimates = [None] * len(representatives)
        for p in sorted(range(len(representatives)), key=lambda p: p != over.first):
            est_p = estimates[p] = one(representatives[p])
            if over.exceeds(est_p):
                break
    classes, results, skipped = [], [], []
    for p, (members, est_or_none) in enumerate(zip(every, estimates)):
        stages = tuple(p + i * shape[d] for i in range(pipeline.stages_per_rank))
        if est_or_none is None:
            skipped.append(stages)
            continue
        est = est_or_none
        phase = cast(Phase, est.trace.peak_phase)  # a simulated step's peak is always in one of its phases
        classes.append(RankClass(members, members[0], stages, est.peak_bytes, est.trace.peak_step, phase.value,
                                 est.trace))
        results.append(est)
    measure: "Callable[[Estimate], SupportsRichComparison]" = key or (lambda e: e.peak_bytes)
    worst = max(range(len(results)), key=lambda i: measure(results[i]))
    table = "; ".join(f"stage(s) {','.join(map(str, c.stages))}: {c.peak_bytes:,} B at step {c.peak_step} "
                      f"{c.peak_phase} (ranks {_ranges(c.ranks)})" for c in classes)
    est, at = results[worst], ",".join(map(str, classes[worst].stages))
    if skipped:
        note = (f"the worst rank simulated is {classes[worst].representative} (stage(s) {at}); the pipeline rank "
                f"classes simulated: {table}; stage(s) {', '.join(','.join(map(str, st)) for st in skipped)} not "
                f"simulated: the batch does not fit the device once stage(s) {at} does not (a plan's search)")
    else:
        peaks = [c.peak_bytes for c in classes]
        spread = (f"spread {max(peaks) - min(peaks):,} B (max / mean {max(peaks) * len(peaks) / sum(peaks):.3f})"
                  if sum(peaks) else "")
        note = (f"the worst rank is {classes[worst].representative} (stage(s) {at}), {spread}; every pipeline rank "
                f"class: {table}")
    return dataclasses.replace(est, notes=(*est.notes, note), ranks=tuple(classes))


def worst_stage(est: "Estimate") -> "int | None":
    """The first pipeline stage of the rank class whose estimate ``est`` is (:func:`pipeline_ranks` returns the
    worst one's); None for an estimate of no pipeline."""
    return next((c.stages[0] for c in est.ranks if c.trace is est.trace), None)


def _ranges(ranks: "tuple[int, ...]") -> str:
    if len(ranks) <= 3:
        return ", ".join(map(str, ranks))
    return f"{ranks[0]}, {ranks[1]}, ... {ranks[-1]}: {len(ranks)}"
