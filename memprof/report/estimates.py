"""Estimates: :func:`estimate`, :func:`estimate_generation` and the planners, returning an :class:`Estimate` or a
:class:`BatchSizePlan`: the records themselves (:mod:`memprof.record.estimate`, :mod:`memprof.record.plans`),
whose text, formula column and Report are the views :mod:`.views` registers."""

from __future__ import annotations


from ..record.estimate import Estimate
from ..record.plans import BatchSizePlan
from ..simulate import estimate as estimating
from ..simulate import generation, planner
from ..simulate.pipeline import Pipeline
from .wrap import same_as, Forwarded

__all__ = ["Estimate", "BatchSizePlan", "Pipeline", "estimate", "estimate_generation", "max_batch_size",
           "max_generation_batch_size"]


@same_as(estimating.estimate)
def estimate(model: Forwarded, optimizer: Forwarded = None, **options: Forwarded) -> Estimate:
    return estimating.estimate(model, optimizer, **options)


@same_as(generation.estimate_generation)
def estimate_generation(model: Forwarded, **options: Forwarded) -> Estimate:
    return generation.estimate_generation(model, **options)


@same_as(planner.max_batch_size)
def max_batch_size(model: Forwarded, optimizer: Forwarded, make_batch: Forwarded, budget: "int | str | None" = None,
                   **options: Forwarded) -> BatchSizePlan:
    return planner.max_batch_size(model, optimizer, make_batch, budget, **options)


@same_as(planner.max_generation_batch_size)
def max_generation_batch_size(model: Forwarded, budget: "int | str | None" = None,
                              **options: Forwarded) -> BatchSizePlan:
    return planner.max_generation_batch_size(model, budget, **options)
