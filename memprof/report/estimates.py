"""Estimates: :func:`estimate`, :func:`estimate_generation` and the planners, returning an :class:`Estimate`
(with its formula column, text and Report) or a :class:`BatchSizePlan` (with its text)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..simulate import estimate as estimating
from ..simulate import generation, planner
from ..simulate.pipeline import Pipeline
from .device import on_device
from .reports import Report
from .wrap import promote, same_as

if TYPE_CHECKING:
    from ..analyse.reconciler import Textbook
    from ..record.trace import Breakdown

__all__ = ["Estimate", "BatchSizePlan", "Pipeline", "estimate", "estimate_generation", "max_batch_size",
           "max_generation_batch_size"]


class Estimate(estimating.Estimate):
    """A simulated run: its :class:`~memprof.Trace`, the formula breakdown beside it and its Report.

    ``peak`` is the composition at the simulated peak; ``formula`` is the
    formula breakdown for the same model and optimizer at that moment (``None``
    for categories without a formula), the one a reconciliation of the run shows;
    ``textbook`` the literature's figure beside it; ``notes`` say what the
    simulation could not reproduce.
    """

    @property
    def formula(self) -> "Breakdown":
        """The formula breakdown at the simulated peak: the one ``est.report().reconcile()`` shows there.

        Its regime is read from the simulated run, as the reconciliation reads it: under ``"mixed"``
        (torch.autocast over fp32 parameters) that is 4 B/param of weights, as torch holds them;
        :attr:`textbook` gives the figure the literature quotes beside it.
        """
        from ..analyse.reconciler import formula_at

        # No precision of its own: `precision` is the user's word for the configuration ("mixed", "amp",
        # "mixed-fp16" are one regime of bytes), and any choice here could differ from the reconciliation's.
        return formula_at(self.trace, "peak")

    @property
    def textbook(self) -> "Textbook":
        """The :class:`~memprof.analyse.reconciler.Textbook` at the simulated peak: the literature's model
        states for this configuration (HF's 18 B/param for mixed-precision AdamW) beside :attr:`formula`,
        and the named causes of their difference in bytes."""
        from ..analyse.reconciler import textbook_at

        return textbook_at(self.trace, "peak")

    def report(self) -> Report:
        """The :class:`~memprof.Report` of the simulated run."""
        return Report(self.trace)

    def to_text(self) -> str:
        """The formula and estimate columns at the simulated peak, the textbook line and the notes: what
        ``print()`` shows."""
        from ..render.text import estimate_text

        return estimate_text(self, self.formula, self.textbook)

    def __str__(self) -> str:
        return self.to_text()


class BatchSizePlan(planner.BatchSizePlan):
    __doc__ = planner.BatchSizePlan.__doc__

    def to_text(self) -> str:
        """The answer, the straight line it started from and the batch sizes simulated: what ``print()`` shows."""
        from ..render.text import plan_text

        return plan_text(self)

    def __str__(self) -> str:
        return self.to_text()


@same_as(estimating.estimate)
def estimate(model: Any, optimizer: Any = None, **options: Any) -> Estimate:
    data = estimating.estimate(model, optimizer, **options)
    return promote(Estimate, data, device_memory=on_device(data.device_memory))


@same_as(generation.estimate_generation)
def estimate_generation(model: Any, **options: Any) -> Estimate:
    data = generation.estimate_generation(model, **options)
    return promote(Estimate, data, device_memory=on_device(data.device_memory))


@same_as(planner.max_batch_size)
def max_batch_size(model: Any, optimizer: Any, make_batch: Any, budget: "int | str | None" = None,
                   **options: Any) -> BatchSizePlan:
    return promote(BatchSizePlan, planner.max_batch_size(model, optimizer, make_batch, budget, **options))


@same_as(planner.max_generation_batch_size)
def max_generation_batch_size(model: Any, budget: "int | str | None" = None, **options: Any) -> BatchSizePlan:
    return promote(BatchSizePlan, planner.max_generation_batch_size(model, budget, **options))
