"""The old home of :class:`~memprof.record.estimate.Estimate`, the record of a simulated run: it lives in
:mod:`memprof.record.estimate` now, and is named here for the simulation's stages that import it from here."""

from __future__ import annotations

from ..record.estimate import Estimate

__all__ = ["Estimate"]
