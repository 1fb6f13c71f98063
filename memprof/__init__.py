"""memprof: where does my training memory go?

Wrap a training loop in :func:`profile`; read :meth:`Profiler.report`.
"""

__version__ = "0.1.0"

from .categories import Category, Phase
from .errors import (
    InvalidArgumentError,
    MemprofError,
    NotMeasuredError,
    ProfilerStateError,
    SizeParseError,
    TraceFormatError,
    UnknownNameError,
)
from .profiler import Profiler, profile
from .estimate import Estimate, estimate
from .reconcile import Reconciliation, reconcile
from .report import Report, load
from .trace import Breakdown, ModuleRecord, PhaseRecord, StepRecord, Trace
from .units import format_bytes, parse_size

__all__ = [
    "profile",
    "Profiler",
    "Report",
    "load",
    "estimate",
    "Estimate",
    "reconcile",
    "Reconciliation",
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
    "NotMeasuredError",
    "TraceFormatError",
    "format_bytes",
    "parse_size",
    "__version__",
]
