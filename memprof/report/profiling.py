"""Profiling a run: :func:`profile` and the :class:`Profiler` whose :meth:`~Profiler.report` reads it."""

from __future__ import annotations


from ..collect import profiler
from .reports import Report
from .wrap import same_as, Forwarded

__all__ = ["Profiler", "profile"]


class Profiler(profiler.Profiler):
    __doc__ = profiler.Profiler.__doc__

    def report(self) -> Report:
        """The :class:`memprof.Report` built on :attr:`trace` (with the allocation stream, when recorded)."""
        from ..simulate.device_memory import AllocationStream

        report = Report(self.trace)
        report.allocations = AllocationStream.of(self.ledger)
        return report


@same_as(profiler.profile)
def profile(model: Forwarded, optimizer: Forwarded = None, **options: Forwarded) -> Profiler:
    return Profiler(model, optimizer, **options)
