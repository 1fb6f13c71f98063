"""The frozen record in the middle: everything measured, nothing live.

A :class:`Trace` holds plain ints and strings only. It is what every
renderer, the reconciler and the pytest budgets read; none of them reach
back into hooks. ``Trace.to_dict()`` / ``Trace.from_dict()`` round-trip
exactly, which is how reports are saved, loaded and diffed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from .categories import Category, Phase
from .checks import corrupt, count, fields, optional_count, optional_text, optional_time, pairs, text
from .errors import TraceFormatError
from .phase_stats import PhaseStats
from .specs import ModuleCall, OptimizerSpec

__all__ = [
    "SCHEMA_VERSION",
    "Breakdown",
    "PhaseRecord",
    "StepRecord",
    "ModuleRecord",
    "Sample",
    "OomRecord",
    "DeviceInfo",
    "ModelFacts",
    "OperationRecord",
    "Trace",
    "as_trace",
    "parent_path",
    "parse_moment",
    "PHASE_MOMENTS",
    "BUDGET_MOMENTS",
    "RECONCILE_MOMENTS",
]

#: Version of the JSON layout written by :meth:`Trace.to_dict`. Readers refuse newer versions.
SCHEMA_VERSION = 4

_ALL = tuple(Category)


@dataclass(frozen=True)
class Breakdown(Mapping[Category, "int | None"]):
    """Bytes by category at one moment.

    Indexing with a :class:`Category` (or its value) gives an ``int`` of
    bytes, or ``None`` when the run could not measure that category (for
    example the allocator overhead on CPU, or temporaries in light mode on
    CPU). ``total`` is the sum of the measured categories, or ``None`` when
    the total itself was not measured. Whenever every tensor category is
    measured, ``sum(tensor categories) == total`` holds exactly.
    """

    counts: tuple["int | None", ...]
    total: "int | None"

    def __post_init__(self) -> None:
        if len(self.counts) != len(_ALL):
            raise TraceFormatError(
                f"a Breakdown needs {len(_ALL)} values (one per Category), got {len(self.counts)}"
            )

    @classmethod
    def from_mapping(cls, values: Mapping["Category | str", "int | None"], total: "int | None" = None,
                     *, compute_total: bool = True) -> "Breakdown":
        """Build from a mapping; missing categories are ``None`` (not measured)."""
        parsed = {Category.parse(k): v for k, v in values.items()}
        vals = tuple(parsed.get(c) for c in _ALL)
        if total is None and compute_total:
            measured = [v for c, v in zip(_ALL, vals) if v is not None]
            total = sum(measured) if measured else None
        return cls(vals, total)

    @classmethod
    def empty(cls) -> "Breakdown":
        return cls(tuple(None for _ in _ALL), None)

    def __getitem__(self, key: "Category | str") -> "int | None":
        return self.counts[_ALL.index(Category.parse(key))]

    def __iter__(self) -> Iterator[Category]:
        return iter(_ALL)

    def __len__(self) -> int:
        return len(_ALL)

    def measured(self) -> dict[Category, int]:
        """Only the categories that were measured."""
        return {c: v for c, v in zip(_ALL, self.counts) if v is not None}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {c.value: v for c, v in zip(_ALL, self.counts)}
        out["total"] = self.total
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Breakdown":
        if not isinstance(data, Mapping):
            raise corrupt(f"a breakdown must be a mapping of category to bytes, got {type(data).__name__}")
        values = tuple(optional_count(data.get(c.value), c.value) for c in _ALL)
        return cls(values, optional_count(data.get("total"), "total"))

    def __repr__(self) -> str:
        inner = ", ".join(f"{c.value}={v}" for c, v in zip(_ALL, self.counts) if v is not None)
        return f"Breakdown(total={self.total}, {inner})"


@dataclass(frozen=True)
class PhaseRecord:
    """One phase of one step: where it started, where it ended, and its peak.

    ``occurrence`` counts phases of the same kind within a step from 0, so
    gradient accumulation gives forward 0, backward 0, forward 1, backward 1.
    ``peak`` is the composition at the moment the phase's total was highest.
    """

    step: int
    phase: Phase
    occurrence: int
    start: Breakdown
    peak: Breakdown
    end: Breakdown
    ops: int = 0
    #: Bytes of named kinds of saved tensors (dropout masks, norm statistics, ...) at the peak and end.
    tags_peak: tuple[tuple[str, int], ...] = ()
    tags_end: tuple[tuple[str, int], ...] = ()
    #: When the phase began, reached its peak and ended: microseconds since the profile started
    #: (schema 4; None in older files). The time axis of the Chrome/Perfetto and memory_viz exports.
    #: Not compared: two records of the same memory are equal however long they took.
    start_us: "float | None" = field(default=None, compare=False)
    peak_us: "float | None" = field(default=None, compare=False)
    end_us: "float | None" = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "phase": self.phase.value,
            "occurrence": self.occurrence,
            "start": self.start.to_dict(),
            "peak": self.peak.to_dict(),
            "end": self.end.to_dict(),
            "ops": self.ops,
            "tags_peak": [list(t) for t in self.tags_peak],
            "tags_end": [list(t) for t in self.tags_end],
            "start_us": self.start_us,
            "peak_us": self.peak_us,
            "end_us": self.end_us,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PhaseRecord":
        return cls(
            step=count(data["step"], "step"),
            phase=Phase.parse(data["phase"]),
            occurrence=count(data["occurrence"], "occurrence"),
            start=Breakdown.from_dict(data["start"]),
            peak=Breakdown.from_dict(data["peak"]),
            end=Breakdown.from_dict(data["end"]),
            ops=count(data.get("ops", 0), "ops"),
            tags_peak=pairs(data.get("tags_peak", ())),
            tags_end=pairs(data.get("tags_end", ())),
            start_us=optional_time(data.get("start_us"), "a phase's start_us"),
            peak_us=optional_time(data.get("peak_us"), "a phase's peak_us"),
            end_us=optional_time(data.get("end_us"), "a phase's end_us"),
        )


@dataclass(frozen=True)
class ModelFacts:
    """What the reconciler needs to know about the model, measured on the live objects at exit.

    Counts are of unique parameters (tied weights once). The ``*_formula``
    fields and ``modules_without_rule`` are read from traces of schema 1 only,
    where the collector computed formulas; newer traces record what a formula
    needs (:attr:`Trace.module_calls`, :attr:`Trace.optimizers`) and
    :mod:`memprof.anatomy.predict` computes them downstream.
    """

    num_params: int = 0
    num_trainable: int = 0
    trainable_tensors: int = 0
    weight_bytes: int = 0
    trainable_bytes: int = 0
    buffer_bytes: int = 0
    optimizer_state_formula: "int | None" = None
    optimizer_transient_formula: "int | None" = None
    activation_formula: "int | None" = None
    #: Bytes of the model's inputs (storages made before the profile: the batch, token ids) that modules
    #: with a saved-bytes rule saved in the first forward. Their rules count them as activations; the
    #: measurement counts them as inputs. ``None`` when no forward was seen.
    activation_inputs_saved: "int | None" = None
    modules_without_rule: tuple[str, ...] = ()
    #: (module path, attribute, value) of Linear/Conv/Embedding dimensions, for the alignment advice.
    dims: tuple[tuple[str, str, int], ...] = ()
    #: First dimension of the model's first input in the first forward.
    batch_size: "int | None" = None

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["modules_without_rule"] = list(self.modules_without_rule)
        out["dims"] = [list(d) for d in self.dims]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelFacts":
        kw = fields(cls, data)
        if "modules_without_rule" in kw:
            kw["modules_without_rule"] = tuple(text(n, "a module type") for n in kw["modules_without_rule"])
        if "dims" in kw:
            kw["dims"] = tuple((text(a, "a module path"), text(b, "a dimension"), count(c, "a dimension"))
                               for a, b, c in kw["dims"])
        return cls(**kw)


@dataclass(frozen=True)
class OperationRecord:
    """All calls of one op in one phase: Ivanov et al.'s class, count, flops and bytes moved."""

    phase: str
    cls: str
    op: str
    count: int
    flops: int
    bytes_read: int
    bytes_written: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "OperationRecord":
        kw = fields(cls, data)
        missing = set(cls.__dataclass_fields__) - set(kw)
        if missing:
            raise corrupt(f"an operation record lacks {sorted(missing)}")
        return cls(**kw)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step (or one ``prof.step()`` block) and its phases, in order."""

    index: int
    phases: tuple[PhaseRecord, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "phases": [p.to_dict() for p in self.phases]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StepRecord":
        return cls(count(data["index"], "a step's index"), tuple(PhaseRecord.from_dict(p) for p in data["phases"]))


@dataclass(frozen=True)
class ModuleRecord:
    """What one module (by its path in the model) held and caused.

    ``parameters`` / ``gradients`` are the bytes of the module's own and its
    children's parameters and gradients (tied storages once) at the end of
    profiling, gradients as last seen after a backward. ``activations`` are the
    bytes autograd saved while this module or a child ran its forward, counted
    once per storage and summed over calls, in the last step that ran it.
    ``peak_forward`` / ``peak_backward`` are the highest rise of live bytes
    above the level at the call's start while the module ran (what the call
    adds at its worst, its outputs and saved tensors included);
    ``temporaries_forward`` / ``temporaries_backward`` are the part of that
    high point released again by the call's end (scratch memory the module
    needs only while it runs). Maxima over calls; ``None`` where not measured
    (light mode) or never run.
    """

    path: str
    type: str
    parameters: int
    gradients: "int | None"
    activations: "int | None"
    peak_forward: "int | None"
    peak_backward: "int | None"
    temporaries_forward: "int | None"
    temporaries_backward: "int | None"
    calls: int
    #: Bytes of the tensors handed to the module's first call in the first forward (None if not seen).
    input_bytes: "int | None" = None
    #: Saved bytes attributed to this module itself, not its children (last step that ran it).
    own_activations: "int | None" = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModuleRecord":
        return cls(**fields(cls, data))


@dataclass(frozen=True)
class Sample:
    """One point of the memory timeline, taken at a module or phase boundary.

    ``event`` says which boundary: "start" (the profile's), "phase" (``label`` is the phase that
    began), "enter" or "exit" (``label`` is a module's path; in backward, its gradient's computation);
    "" in files older than schema 4, which also have no ``time_us``.
    """

    seq: int
    step: int
    phase: Phase
    label: str
    breakdown: Breakdown
    #: Microseconds since the profile started (not compared, as a phase's times).
    time_us: "float | None" = field(default=None, compare=False)
    event: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "step": self.step, "phase": self.phase.value, "label": self.label,
                "breakdown": self.breakdown.to_dict(), "time_us": self.time_us, "event": self.event}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Sample":
        event = text(data.get("event", ""), "a sample's event")
        if event not in SAMPLE_EVENTS:
            raise corrupt(f"a sample's event must be one of {', '.join(map(repr, SAMPLE_EVENTS))}, got {event[:20]!r}")
        return cls(count(data["seq"], "a sample's seq"), count(data["step"], "a sample's step"),
                   Phase.parse(data["phase"]), text(data["label"], "a sample's label"),
                   Breakdown.from_dict(data["breakdown"]), optional_time(data.get("time_us"), "a sample's time_us"),
                   event)


#: What a timeline sample marks (see :class:`Sample`).
SAMPLE_EVENTS = ("", "start", "phase", "enter", "exit")


@dataclass(frozen=True)
class OomRecord:
    """An out-of-memory error that ended the profile (``profile(..., oom_dump=...)`` writes the trace).

    ``requested`` is the allocation that failed, ``device_free`` and ``device_total`` what the device
    reported at that moment (None where unknown: CPU, or a message that did not say). ``snapshot`` is
    the memory_viz snapshot written beside the dump (CUDA with memory history recorded), if any.
    """

    message: str
    requested: "int | None" = None
    device_free: "int | None" = None
    device_total: "int | None" = None
    snapshot: "str | None" = None

    def to_dict(self) -> dict[str, Any]:
        return {"message": self.message, "requested": self.requested, "device_free": self.device_free,
                "device_total": self.device_total, "snapshot": self.snapshot}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "OomRecord":
        return cls(text(data["message"], "the OOM message"), optional_count(data.get("requested"), "requested"),
                   optional_count(data.get("device_free"), "device_free"),
                   optional_count(data.get("device_total"), "device_total"),
                   optional_text(data.get("snapshot"), "the OOM snapshot"))


@dataclass(frozen=True)
class DeviceInfo:
    """Where the run happened, and what the device itself reported."""

    type: str
    name: str
    index: "int | None" = None
    total_memory: "int | None" = None
    #: Sizes are rounded as this allocator rounds (512 on CUDA, 1 on CPU).
    rounding: int = 1
    #: Device-level figures at the global peak or at exit (CUDA only), None elsewhere.
    max_memory_allocated: "int | None" = None
    memory_reserved: "int | None" = None
    nvml_used: "int | None" = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DeviceInfo":
        return cls(**fields(cls, data))


@dataclass(frozen=True)
class Trace:
    """Everything one profiling session measured. Immutable; save it with :meth:`to_dict`.

    ``peak`` is the composition at the highest total over the whole session,
    ``start`` when profiling began and ``end`` when it ended. ``notes`` are
    sentences a reader must see (what was not measured, what degraded).
    ``error`` names the exception that ended the profiled body, if any.
    """

    mode: str
    device: DeviceInfo
    torch_version: str
    memprof_version: str
    start: Breakdown
    peak: Breakdown
    end: Breakdown
    peak_step: "int | None"
    peak_phase: "Phase | None"
    peak_module: "str | None"
    steps: tuple[StepRecord, ...]
    modules: tuple[ModuleRecord, ...]
    timeline: tuple[Sample, ...] = ()
    notes: tuple[str, ...] = ()
    error: "str | None" = None
    live_at_error: "Breakdown | None" = None
    live_modules_at_error: tuple[tuple[str, int], ...] = ()
    optimizer: "str | None" = None
    optimizer_implementation: "str | None" = None
    param_dtypes: tuple[str, ...] = ()
    autocast_dtype: "str | None" = None
    peak_tags: tuple[tuple[str, int], ...] = ()
    facts: ModelFacts = field(default_factory=ModelFacts)
    #: Per-op records when profiled with operations=True; None when not recorded.
    operations: "tuple[OperationRecord, ...] | None" = None
    #: The first grad-enabled forward's module calls, for the per-module formula (schema 2 and later).
    module_calls: tuple[ModuleCall, ...] = ()
    #: The optimizers that stepped the model, for the optimizer formulas (schema 2 and later).
    optimizers: tuple[OptimizerSpec, ...] = ()
    #: Steps the run had; ``steps`` holds those kept in full (schema 3 and later; older files kept all).
    num_steps: "int | None" = None
    #: Every recorded step's phases summarised per (phase, occurrence), kept in full or not (schema 3).
    phase_stats: tuple[PhaseStats, ...] = ()
    #: The schedule that chose the steps to record (``memprof.schedule(...)`` in words), if one did.
    schedule: "str | None" = None
    #: With a schedule: the (first, last) step of each stretch of recorded steps.
    recorded_steps: tuple[tuple[int, int], ...] = ()
    #: The out-of-memory error that ended the run, if one did (schema 4).
    oom: "OomRecord | None" = None
    #: At an error: each live storage memprof knew, as (address, bytes, category, module path or ""),
    #: largest first, at most 100,000 (schema 4). What attributes a memory_viz snapshot's blocks.
    live_storages_at_error: tuple[tuple[int, int, str, str], ...] = ()
    schema_version: int = field(default=SCHEMA_VERSION)

    def __post_init__(self) -> None:
        if self.num_steps is None:
            object.__setattr__(self, "num_steps", len(self.steps))

    @property
    def phases(self) -> tuple[PhaseRecord, ...]:
        return tuple(p for s in self.steps for p in s.phases)

    def peak_location(self) -> list[str]:
        """Where the peak was, in words: step, phase and module (for headings)."""
        where = []
        if self.peak.total is None:
            where.append("categories at the highest measured level")
        if self.peak_step is not None:
            where.append(f"step {self.peak_step}")
        if self.peak_phase is not None:
            where.append(self.peak_phase.value)
        if self.peak_module:
            where.append(f"in {self.peak_module}")
        return where

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "memprof.trace",
            "schema_version": self.schema_version,
            "mode": self.mode,
            "device": self.device.to_dict(),
            "torch_version": self.torch_version,
            "memprof_version": self.memprof_version,
            "start": self.start.to_dict(),
            "peak": self.peak.to_dict(),
            "end": self.end.to_dict(),
            "peak_step": self.peak_step,
            "peak_phase": self.peak_phase.value if self.peak_phase is not None else None,
            "peak_module": self.peak_module,
            "steps": [s.to_dict() for s in self.steps],
            "modules": [m.to_dict() for m in self.modules],
            "timeline": [s.to_dict() for s in self.timeline],
            "notes": list(self.notes),
            "error": self.error,
            "live_at_error": self.live_at_error.to_dict() if self.live_at_error is not None else None,
            "live_modules_at_error": [list(x) for x in self.live_modules_at_error],
            "optimizer": self.optimizer,
            "optimizer_implementation": self.optimizer_implementation,
            "param_dtypes": list(self.param_dtypes),
            "autocast_dtype": self.autocast_dtype,
            "peak_tags": [list(t) for t in self.peak_tags],
            "facts": self.facts.to_dict(),
            "operations": [o.to_dict() for o in self.operations] if self.operations is not None else None,
            "module_calls": [c.to_dict() for c in self.module_calls],
            "optimizers": [o.to_dict() for o in self.optimizers],
            "num_steps": self.num_steps,
            "phase_stats": [p.to_dict() for p in self.phase_stats],
            "schedule": self.schedule,
            "recorded_steps": [list(r) for r in self.recorded_steps],
            "oom": self.oom.to_dict() if self.oom is not None else None,
            "live_storages_at_error": [list(s) for s in self.live_storages_at_error],
        }

    @classmethod
    def from_dict(cls, data: Any) -> "Trace":
        if not isinstance(data, Mapping) or data.get("format") != "memprof.trace":
            raise TraceFormatError(
                "this is not a memprof trace (no 'format': 'memprof.trace' key); "
                "save one with report.save(path)"
            )
        version = data.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise TraceFormatError(
                f"corrupt memprof trace: schema_version {version!r} is not a positive int; "
                "re-create it with report.save(path)"
            )
        if version > SCHEMA_VERSION:
            raise TraceFormatError(
                f"trace schema version {version!r} is newer than this memprof understands "
                f"({SCHEMA_VERSION}); upgrade torch-memprof to read it"
            )
        try:
            return cls(
                mode=_mode(data["mode"]),
                device=DeviceInfo.from_dict(data["device"]),
                torch_version=text(data["torch_version"], "torch_version"),
                memprof_version=text(data["memprof_version"], "memprof_version"),
                start=Breakdown.from_dict(data["start"]),
                peak=Breakdown.from_dict(data["peak"]),
                end=Breakdown.from_dict(data["end"]),
                peak_step=_peak_step(data),
                peak_phase=Phase.parse(data["peak_phase"]) if data.get("peak_phase") else None,
                peak_module=optional_text(data.get("peak_module"), "peak_module"),
                steps=tuple(StepRecord.from_dict(s) for s in data["steps"]),
                modules=tuple(ModuleRecord.from_dict(m) for m in data["modules"]),
                timeline=tuple(Sample.from_dict(s) for s in data.get("timeline", ())),
                notes=tuple(text(n, "a note") for n in data.get("notes", ())),
                error=optional_text(data.get("error"), "error"),
                live_at_error=Breakdown.from_dict(data["live_at_error"]) if data.get("live_at_error") else None,
                live_modules_at_error=tuple((text(a, "a module path"), count(b, "a module's bytes"))
                                            for a, b in data.get("live_modules_at_error", ())),
                optimizer=optional_text(data.get("optimizer"), "optimizer"),
                optimizer_implementation=optional_text(data.get("optimizer_implementation"),
                                                        "optimizer_implementation"),
                param_dtypes=tuple(text(d, "a dtype") for d in data.get("param_dtypes", ())),
                autocast_dtype=optional_text(data.get("autocast_dtype"), "autocast_dtype"),
                peak_tags=pairs(data.get("peak_tags", ())),
                facts=ModelFacts.from_dict(data.get("facts", {})),
                operations=tuple(OperationRecord.from_dict(o) for o in data["operations"])
                if data.get("operations") is not None else None,
                module_calls=tuple(ModuleCall.from_dict(c) for c in data.get("module_calls", ())),
                optimizers=tuple(OptimizerSpec.from_dict(o) for o in data.get("optimizers", ())),
                num_steps=optional_count(data.get("num_steps"), "num_steps"),
                phase_stats=tuple(PhaseStats.from_dict(p) for p in data.get("phase_stats", ())),
                schedule=optional_text(data.get("schedule"), "schedule"),
                recorded_steps=tuple((count(a, "a recorded step"), count(b, "a recorded step"))
                                     for a, b in data.get("recorded_steps", ())),
                oom=OomRecord.from_dict(data["oom"]) if data.get("oom") is not None else None,
                live_storages_at_error=tuple(
                    (count(a, "a storage's address"), count(n, "a storage's bytes"),
                     Category.parse(text(c, "a storage's category")).value, text(m, "a storage's module"))
                    for a, n, c, m in data.get("live_storages_at_error", ())),
                schema_version=version,
            )
        except TraceFormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise corrupt(repr(exc)) from None


def _mode(value: Any) -> str:
    if value not in ("full", "light"):
        raise corrupt(f"mode must be 'full' or 'light', got {text(value, 'mode')[:20]!r}")
    return value


def _peak_step(data: Mapping[str, Any]) -> "int | None":
    step = optional_count(data.get("peak_step"), "peak_step")
    indices = [s.get("index") for s in data.get("steps", ()) if isinstance(s, Mapping)]
    if step is not None and indices and all(isinstance(i, int) for i in indices) and step > max(indices):
        raise corrupt(f"peak_step {step} is after the last step recorded ({max(indices)})")
    return step


# -- moments: one vocabulary for "at which instant", the ``at=`` of every API -----------------------

#: A phase's (or the run's) highest total, its first and its last moment.
PEAK, START, END = "peak", "start", "end"
#: The end of the last optimizer step: every model state exists (reconciliation only).
STEADY = "steady"
#: Where each API reads its figures: a phase or the run (Report.at, breakdown_frame, diff), a budget
#: (check_budget, the memory_budget marker), a reconciliation.
PHASE_MOMENTS = (PEAK, START, END)
BUDGET_MOMENTS = (PEAK, END)
RECONCILE_MOMENTS = (PEAK, STEADY)


def parse_moment(value: Any, allowed: tuple[str, ...], name: str = "at") -> str:
    """``value`` if it is one of ``allowed`` moments; else an InvalidArgumentError that lists them."""
    from .errors import InvalidArgumentError

    if isinstance(value, str) and value.strip().lower() in allowed:
        return value.strip().lower()
    natural = ", ".join(allowed[:-1]) + f" or {allowed[-1]}" if len(allowed) > 1 else allowed[0]
    raise InvalidArgumentError(f"{name} must be {natural} (one of {', '.join(allowed)}), got {value!r}")


def parent_path(path: str) -> str:
    """The path of a module's parent in the model's tree ("" for the root's children and the root)."""
    return path.rpartition(".")[0]


def as_trace(obj: Any) -> Trace:
    """The Trace of a Report, or the Trace itself; anything else is refused with a clear error."""
    from .errors import InvalidArgumentError

    trace = getattr(obj, "trace", obj)
    if not isinstance(trace, Trace):
        raise InvalidArgumentError(
            f"expected a memprof Report or Trace, got {type(obj).__name__}; use prof.report() or memprof.load(path)"
        )
    return trace
