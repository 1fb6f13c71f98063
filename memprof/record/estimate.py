"""What a simulation returns: :class:`Estimate`, the record of a simulated run, and :class:`WhatIf`, a measured
run's change simulated. Plain data, no torch needed to read them; :func:`memprof.estimate`, the stages of
:mod:`memprof.simulate.stages` and :func:`memprof.simulate.whatif.what_if` make them. Their text, formula column
and Report are views registered from above (:mod:`.views`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..vocabulary import Category
from .trace import Breakdown, Trace
from .aliases import Above, Setting
from .views import show

if TYPE_CHECKING:
    from .device_memory import DeviceMemory

__all__ = ["Estimate", "WhatIf"]


@dataclass(frozen=True)
class Estimate:
    """A simulated run: its :class:`~memprof.Trace`, the formula breakdown beside it and its Report.

    ``peak`` is the composition at the simulated peak; ``formula`` is the
    formula breakdown for the same model and optimizer at that moment (``None``
    for categories without a formula), the one a reconciliation of the run shows;
    ``textbook`` the literature's figure beside it; ``notes`` say what the
    simulation could not reproduce.
    """

    trace: Trace
    precision: str
    device: str
    notes: tuple[str, ...] = ()
    #: A CUDA target's device-level figures (the allocator replay, the memory outside torch); None for others.
    device_memory: "DeviceMemory | None" = None

    @property
    def device_peak(self) -> "int | None":
        """Peak bytes on the device: the replay's peak reserved plus the memory outside torch (None off CUDA)."""
        return None if self.device_memory is None else self.device_memory.device_peak

    @property
    def fits(self) -> "bool | None":
        """Does :attr:`device_peak` fit the ``gpu=`` given (None without one)?"""
        return None if self.device_memory is None else self.device_memory.fits

    @property
    def headroom(self) -> "int | None":
        """The GPU's capacity less :attr:`device_peak` (negative when it does not fit; None without a GPU)."""
        return None if self.device_memory is None else self.device_memory.headroom

    #: Under FSDP2's CPUOffloadPolicy (``parallelize=``): the rank's host bytes and its device peak; the trace's
    #: categories hold both together (the notes say how they were split). ``None`` otherwise.
    host_bytes: "int | None" = None
    device_peak_bytes: "int | None" = None
    #: With ``pipeline=`` and no ``rank=``: every rank class simulated (:class:`memprof.simulate.pipeline.RankClass`);
    #: the estimate itself is the worst one's.
    ranks: tuple[Above, ...] = ()

    @property
    def peak(self) -> Breakdown:
        """The composition at the simulated peak (as :attr:`memprof.Report.peak` is a run's)."""
        return self.trace.peak

    @property
    def peak_bytes(self) -> int:
        """Simulated peak of tensor bytes (rounded as the target device's allocator rounds); the device's own
        figure, cache and outside torch included, is :attr:`device_peak`."""
        return self.trace.peak.tensor_bytes

    # -- views (registered by memprof.report.views) ----------------------------------------------------------

    @property
    def formula(self) -> Breakdown:
        """The formula breakdown at the simulated peak: the one ``est.report().reconcile()`` shows there.

        Its regime is read from the simulated run, as the reconciliation reads it: under ``"mixed"``
        (torch.autocast over fp32 parameters) that is 4 B/param of weights, as torch holds them;
        :attr:`textbook` gives the figure the literature quotes beside it.
        """
        formula: Breakdown = show(self, "formula")
        return formula

    @property
    def textbook(self) -> Above:
        """The :class:`~memprof.analyse.reconciler.Textbook` at the simulated peak: the literature's model
        states for this configuration (HF's 18 B/param for mixed-precision AdamW) beside :attr:`formula`,
        and the named causes of their difference in bytes."""
        return show(self, "textbook")

    def report(self) -> Above:
        """The :class:`~memprof.Report` of the simulated run."""
        return show(self, "report")

    def to_text(self) -> str:
        """The formula and estimate columns at the simulated peak, the textbook line and the notes: what
        ``print()`` shows."""
        text: str = show(self, "to_text")
        return text

    def __str__(self) -> str:
        return self.to_text()


@dataclass(frozen=True)
class WhatIf(Estimate):
    """The changed run's :class:`Estimate`, and ``baseline``, the measured run's
    breakdown at its peak: ``saving`` is, per category, the baseline's bytes less the changed run's at its
    peak (None where either has no figure); ``saving_bytes`` the same for the tensors' peak. ``changes`` says
    what was changed."""

    baseline: "Breakdown | None" = None
    baseline_peak_bytes: "int | None" = None
    changes: tuple[tuple[str, Setting], ...] = ()

    @property
    def saving(self) -> dict[str, "int | None"]:
        if self.baseline is None:
            return {c.value: None for c in Category}
        out: dict[str, "int | None"] = {}
        for c in Category:
            old, new = self.baseline[c], self.peak[c]
            out[c.value] = None if old is None or new is None else old - new
        return out

    @property
    def saving_bytes(self) -> "int | None":
        return None if self.baseline_peak_bytes is None else self.baseline_peak_bytes - self.peak_bytes

    def to_text(self) -> str:
        """The change, the measured and the predicted breakdowns at their peaks and the saving per category, then
        the notes: what ``print()`` shows."""
        text: str = show(self, "to_text")
        return text
