"""What a simulation returns: :class:`Estimate`, the record of a simulated run (plain data, no torch needed to
read it). :func:`memprof.simulate.estimate.estimate` and the stages of :mod:`memprof.simulate.stages` make it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..record.trace import Breakdown, Trace
from ..vocabulary import TENSOR_CATEGORIES

if TYPE_CHECKING:
    from .device_memory import DeviceMemory

__all__ = ["Estimate"]


@dataclass(frozen=True)
class Estimate:
    """A simulated run: its :class:`~memprof.record.trace.Trace`, the precision and device it was simulated
    for, and ``notes`` that say what the simulation could not reproduce. Plain data: ``memprof.estimate``
    returns it with its formula column, text and report (:mod:`memprof.report`)."""

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
    ranks: tuple = ()

    @property
    def peak(self) -> Breakdown:
        """The composition at the simulated peak (as :attr:`memprof.Report.peak` is a run's)."""
        return self.trace.peak

    @property
    def peak_bytes(self) -> int:
        """Simulated peak of tensor bytes (rounded as the target device's allocator rounds); the device's own
        figure, cache and outside torch included, is :attr:`device_peak`."""
        return sum(v or 0 for v in self.trace.peak.counts[:len(TENSOR_CATEGORIES)])
