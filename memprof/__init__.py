"""memprof: where does my training memory go?

Wrap a training loop in :func:`profile`; read :meth:`Profiler.report`.

Importing memprof does not import torch: the names that need it
(``profile``, ``estimate``, ``reconcile`` ...) load on first use, so the
pytest plugin costs nothing in projects that do not use it. The errors are
:mod:`memprof.errors`' and the record's parts :mod:`memprof.record`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .version import __version__

from .analyse.budget import check_budget
from .collect.schedule import Schedule, schedule
from .errors import MemprofError
from .record.trace import Breakdown, Trace
from .report import Diff, Merged, Report, diff, load, merge
from .units import format_bytes, parse_size
from .vocabulary import Category, Phase

if TYPE_CHECKING:
    from .record.aliases import LazyName
    from .report.estimates import (BatchSizePlan, Estimate, Pipeline, estimate, estimate_generation, max_batch_size,
                                   max_generation_batch_size)
    from .report.planning import estimate_hf, plan
    from .report.profiling import Profiler, profile
    from .report.reconciliation import Reconciliation, reconcile


def __getattr__(name: str) -> "LazyName":
    import importlib

    from . import report

    if name == "anatomy":
        return importlib.import_module(".anatomy", __name__)
    if name not in report.LAZY:
        raise AttributeError(f"module 'memprof' has no attribute {name!r}")
    value = getattr(report, name)
    globals()[name] = value
    return value


__all__ = [
    "profile",
    "Profiler",
    "Report",
    "load",
    "estimate",
    "estimate_generation",
    "estimate_hf",
    "Estimate",
    "Pipeline",
    "reconcile",
    "Reconciliation",
    "max_batch_size",
    "max_generation_batch_size",
    "BatchSizePlan",
    "plan",
    "diff",
    "Diff",
    "merge",
    "Merged",
    "schedule",
    "Schedule",
    "check_budget",
    "Trace",
    "Breakdown",
    "Category",
    "Phase",
    "format_bytes",
    "parse_size",
    "MemprofError",
    "__version__",
]
