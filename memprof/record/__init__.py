"""The frozen record in the middle: a :class:`Trace` and its parts, plain ints and strings, torch-free.

Everything measured (:mod:`memprof.collect`) or simulated (:mod:`memprof.simulate`) ends here, and
everything downstream reads it. ``Trace.to_dict()`` / ``Trace.from_dict()`` round-trip exactly
(:mod:`.files` writes and reads them).
"""

from __future__ import annotations

from .parts import (Breakdown, DeviceInfo, GenerationFacts, ModelFacts, ModuleRecord, OomRecord, OperationRecord,
                    PhaseRecord, RankInfo, Sample, StepRecord)
from .specs import ModuleCall, OptimizerSpec, ParamSpec, TensorSpec
from .stats import PhaseStats, Stat
from .trace import SCHEMA_VERSION, Trace

__all__ = ["Trace", "SCHEMA_VERSION", "Breakdown", "PhaseRecord", "StepRecord", "ModuleRecord", "Sample",
           "OomRecord", "DeviceInfo", "RankInfo", "GenerationFacts", "ModelFacts", "OperationRecord", "PhaseStats",
           "Stat", "ModuleCall", "OptimizerSpec", "ParamSpec", "TensorSpec"]
