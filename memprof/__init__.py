"""memprof: where does my training memory go?

Wrap a training loop in :func:`profile`; read :meth:`Profiler.report`.

Importing memprof does not import torch: the names that need it
(``profile``, ``estimate``, ``reconcile`` ...) load on first use, so the
pytest plugin costs nothing in projects that do not use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .version import __version__

from .analyse.budget import BudgetNotMeasured, MemoryBudgetExceeded, MemoryGrewError, check_budget
from .vocabulary import Category, Phase
from .analyse.compare import Diff, diff
from .errors import (
    InvalidArgumentError,
    MemprofError,
    NotMeasuredError,
    ProfilerStateError,
    MergeError,
    SimulationError,
    SizeParseError,
    TraceFormatError,
    UnknownNameError,
)
from .report import Report, load
from .collect.schedule import Schedule, schedule
from .record.trace import Breakdown, ModuleRecord, PhaseRecord, StepRecord, Trace
from .units import format_bytes, parse_size

if TYPE_CHECKING:
    from .simulate.generation import estimate_generation
    from .simulate.estimate import Estimate, estimate
    from .collect.profiler import Profiler, profile
    from .analyse.reconciler import Reconciliation, reconcile

_LAZY = {
    "profile": "collect.profiler",
    "Profiler": "collect.profiler",
    "estimate": "simulate.estimate",
    "estimate_generation": "simulate.generation",
    "Estimate": "simulate.estimate",
    "reconcile": "analyse.reconciler",
    "Reconciliation": "analyse.reconciler",
    "max_batch_size": "simulate.planner",
    "merge": "analyse.merge",
    "Merged": "analyse.merge",
    "max_generation_batch_size": "simulate.planner",
    "BatchSizePlan": "simulate.planner",
}


def __getattr__(name: str) -> Any:
    if name == "anatomy":
        import importlib

        return importlib.import_module(".anatomy", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memprof' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "profile",
    "Profiler",
    "Report",
    "load",
    "estimate",
    "estimate_generation",
    "Estimate",
    "reconcile",
    "Reconciliation",
    "max_batch_size",
    "max_generation_batch_size",
    "BatchSizePlan",
    "diff",
    "Diff",
    "merge",
    "Merged",
    "schedule",
    "Schedule",
    "check_budget",
    "MemoryBudgetExceeded",
    "BudgetNotMeasured",
    "MemoryGrewError",
    "Trace",
    "Breakdown",
    "StepRecord",
    "PhaseRecord",
    "ModuleRecord",
    "Category",
    "Phase",
    "MemprofError",
    "ProfilerStateError",
    "InvalidArgumentError",
    "UnknownNameError",
    "SizeParseError",
    "SimulationError",
    "MergeError",
    "NotMeasuredError",
    "TraceFormatError",
    "format_bytes",
    "parse_size",
    "__version__",
]
