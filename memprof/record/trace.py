"""The frozen record in the middle: everything measured, nothing live.

A :class:`Trace` holds plain ints and strings only. It is what every
renderer, the reconciler and the pytest budgets read; none of them reach
back into hooks. ``Trace.to_dict()`` / ``Trace.from_dict()`` round-trip
exactly, which is how reports are saved, loaded and diffed.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Protocol, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar, cast

from ..vocabulary import TENSOR_CATEGORIES, Category, Phase
from . import fields as fileform
from .fields import form
from .aliases import JSONObject
from .checks import corrupt, count, listed_once, member, optional_count, optional_text, pairs, seq, text
from ..errors import TraceFormatError, is_interrupt
from .stats import PhaseStats
from .parts import (Breakdown, DeviceInfo, GenerationFacts, ModelFacts, ModuleRecord, OomRecord,
                      OperationRecord, PhaseRecord, RankInfo, Sample, StepRecord)
from .routing import RoutingRecord
from .specs import ModuleCall, OptimizerSpec

__all__ = [
    "SCHEMA_VERSION",
    "OPTIMIZER_STEP_KINDS",
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
    "steps_held",
]

#: Version of the JSON layout written by :meth:`Trace.to_dict`. Readers refuse newer versions.
SCHEMA_VERSION = 7

#: What a step's optimizer phases were (:attr:`Trace.optimizer_steps`): measured op by op; carried from an
#: earlier measured step of the same optimizer (the same figures); some measured and some carried (several
#: optimizers); carried and found changed afterwards (the peak an upper bound); cut short by an error while
#: carried (temporaries not measured).
OPTIMIZER_STEP_KINDS = ("measured", "carried", "partly carried", "unverified", "not measured")


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
    #: Steps the run had; ``steps`` holds those kept in full (schema 3 and later; older files kept all, and the
    #: loader counts them: :func:`steps_held`). Keyword-only and required: whoever builds a trace knows it.
    num_steps: int = field(kw_only=True)
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
    #: A run that decoded with a KV cache: what the cache formula needs (schema 5).
    generation: "GenerationFacts | None" = None
    #: The rank of a torch.distributed job the run was (schema 5); None outside a process group.
    distributed: "RankInfo | None" = None
    #: With ``record_routing=True``: every router call's per-expert token counts (schema 6).
    routing: "RoutingRecord | None" = None
    #: Exact mode: which steps' optimizer phases were measured and which carried, as (first step, last step,
    #: kind) spans in the order they ran, kinds from :data:`OPTIMIZER_STEP_KINDS` (schema 7; empty where
    #: carrying was off: light mode, ``carry_optimizer_steps=False`` and the options that measure every step,
    #: a simulation; or a file written before it).
    optimizer_steps: tuple[tuple[int, int, str], ...] = ()
    schema_version: int = field(default=SCHEMA_VERSION, metadata=form(written=False))

    @property
    def phases(self) -> tuple[PhaseRecord, ...]:
        return tuple(p for s in self.steps for p in s.phases)

    def peak_record(self) -> "PhaseRecord | None":
        """The kept phase that holds the run's peak: of the phases of the peak's step and kind, the one
        with the highest peak (the first of equals, where the total first reached it). None when that
        step is not kept in full."""
        best = None
        for p in self.phases:
            if p.step == self.peak_step and p.phase is self.peak_phase and (
                    best is None or sum(p.peak.measured().values()) > sum(best.peak.measured().values())):
                best = p
        return best

    def peak_phase_label(self) -> "str | None":
        """The peak's phase as the phase tables name it: ``backward``, or ``backward #1`` for the second
        backward of its step (gradient accumulation's second micro-batch)."""
        if self.peak_phase is None:
            return None
        rec = self.peak_record()
        return self.peak_phase.value + (f" #{rec.occurrence}" if rec is not None and rec.occurrence else "")

    def peak_location(self) -> list[str]:
        """Where the peak was, in words: step, phase and module as the tables name them (for headings:
        ``["step 1", "backward #1", "in 1 (ReLU)"]``)."""
        where = []
        if self.peak.total is None:
            where.append("categories at the highest measured level")
        if self.peak_step is not None:
            where.append(f"step {self.peak_step}")
        label = self.peak_phase_label()
        if label is not None:
            where.append(label)
        if self.peak_module:
            kind = next((m.type for m in self.modules if m.path == self.peak_module), None)
            where.append(f"in {self.peak_module}" + (f" ({kind})" if kind else ""))
        return where

    def to_dict(self) -> JSONObject:
        # The format's name and schema version first, then every field from its own (record/fields.py).
        return {"format": "memprof.trace", "schema_version": self.schema_version, **fileform.write(self)}

    # Read by hand, not from its fields: the format and schema version refused before anything else, the
    # mode's older word, a peak step older files leave out, and the checks across parts (_consistent) that
    # no field's annotation can say.
    @classmethod
    def from_dict(cls, data: object) -> "Trace":
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
            stated_steps = optional_count(data.get("num_steps"), "num_steps")
            trace = cls(
                mode=_mode(data["mode"]),
                device=DeviceInfo.from_dict(data["device"]),
                torch_version=text(data["torch_version"], "torch_version"),
                memprof_version=text(data["memprof_version"], "memprof_version"),
                start=Breakdown.from_dict(data["start"]),
                peak=Breakdown.from_dict(data["peak"]),
                end=Breakdown.from_dict(data["end"]),
                peak_step=_peak_step(data),
                peak_phase=_optional(data, "peak_phase", lambda v: member(v, Phase, "peak_phase")),
                peak_module=optional_text(data.get("peak_module"), "peak_module"),
                steps=_steps(data["steps"]),
                modules=_modules(data["modules"]),
                timeline=tuple(Sample.from_dict(s) for s in _list(data, "timeline")),
                notes=tuple(text(n, "a note") for n in _list(data, "notes")),
                error=optional_text(data.get("error"), "error"),
                live_at_error=_optional(data, "live_at_error", Breakdown.from_dict),
                live_modules_at_error=_live_modules(data),
                optimizer=optional_text(data.get("optimizer"), "optimizer"),
                optimizer_implementation=optional_text(data.get("optimizer_implementation"),
                                                        "optimizer_implementation"),
                param_dtypes=tuple(text(d, "a dtype") for d in _list(data, "param_dtypes")),
                autocast_dtype=optional_text(data.get("autocast_dtype"), "autocast_dtype"),
                peak_tags=pairs(data.get("peak_tags", ()), "peak_tags"),
                facts=ModelFacts.from_dict(data.get("facts", {})),
                operations=tuple(OperationRecord.from_dict(o) for o in seq(data["operations"], "operations"))
                if data.get("operations") is not None else None,
                module_calls=tuple(ModuleCall.from_dict(c) for c in _list(data, "module_calls")),
                optimizers=tuple(OptimizerSpec.from_dict(o) for o in _list(data, "optimizers")),
                num_steps=0 if stated_steps is None else stated_steps,  # counted below when the file does not say
                phase_stats=_phase_stats(data),
                schedule=optional_text(data.get("schedule"), "schedule"),
                recorded_steps=tuple(_span(a, b) for a, b in _rows(data, "recorded_steps", 2)),
                oom=_optional(data, "oom", OomRecord.from_dict),
                live_storages_at_error=tuple(
                    (count(a, "a storage's address"), count(n, "a storage's bytes"),
                     member(c, Category, "a storage's category").value, text(m, "a storage's module"))
                    for a, n, c, m in _rows(data, "live_storages_at_error", 4)),
                generation=_optional(data, "generation", GenerationFacts.from_dict),
                distributed=_optional(data, "distributed", RankInfo.from_dict),
                routing=_optional(data, "routing", RoutingRecord.from_dict),
                optimizer_steps=_optimizer_steps(data),
                schema_version=version,
            )
            if stated_steps is None:
                trace = dataclasses.replace(trace, num_steps=steps_held(trace))
        except TraceFormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            raise corrupt(repr(exc)) from None
        _consistent(trace, stated_steps=stated_steps is not None)
        return trace


def _mode(value: object) -> str:
    if value == "full":
        return "exact"  # the word files written before the mode's rename use (any schema version)
    if value == "exact" or value == "light":
        return "exact" if value == "exact" else "light"
    raise corrupt(f"mode must be 'exact' or 'light', got {text(value, 'mode')[:20]!r}")


R = TypeVar("R")


def _optional(data: Mapping[str, object], key: str, read: "Callable[[object], R]") -> "R | None":
    """An optional part of a trace: absent or null is None; anything else is read, so a 0, "" or [] in
    its place is refused rather than taken for "none"."""
    value = data.get(key)
    return None if value is None else read(value)


def _list(data: Mapping[str, object], key: str) -> Sequence[object]:
    """An optional list of a trace (absent in older files: empty)."""
    return seq(data.get(key, ()), key)


def _rows(data: Mapping[str, object], key: str, width: int) -> Iterator[Sequence[object]]:
    """An optional list of fixed-width rows, each checked to be a list of ``width`` values."""
    return (seq(row, f"an entry of {key}", width) for row in _list(data, key))


def _span(first: object, last: object) -> tuple[int, int]:
    a, b = count(first, "a recorded step"), count(last, "a recorded step")
    if a > b:
        raise corrupt(f"a stretch of recorded steps ends ({b}) before it starts ({a})")
    return a, b


def _optimizer_steps(data: Mapping[str, object]) -> tuple[tuple[int, int, str], ...]:
    """The spans of optimizer steps by kind, each in order after the one before (absent before schema 7)."""
    out: list[tuple[int, int, str]] = []
    for a, b, kind in _rows(data, "optimizer_steps", 3):
        first, last = _span(a, b)
        if kind not in OPTIMIZER_STEP_KINDS:
            raise corrupt(f"an optimizer step's kind must be one of {', '.join(OPTIMIZER_STEP_KINDS)}; got "
                          f"{text(kind, 'a kind')[:20]!r}")
        if out and first <= out[-1][1]:
            raise corrupt(f"optimizer steps {first}-{last} are recorded after steps up to {out[-1][1]}")
        out.append((first, last, kind))
    return tuple(out)


def _steps(items: object) -> tuple[StepRecord, ...]:
    """The steps kept in full, in the order they ran (each index once), their phases in time order."""
    steps = tuple(StepRecord.from_dict(s) for s in seq(items, "steps"))
    for a, b in zip(steps, steps[1:]):
        if b.index <= a.index:
            raise corrupt(f"step {b.index} is recorded after step {a.index}")
    _in_time_order(steps)
    return steps


def _in_time_order(steps: tuple[StepRecord, ...]) -> None:
    """Where a file gives a phase's times (schema 4 and later), each phase starts, peaks and ends in that order,
    and starts no earlier than the phases recorded before it ended: phases run one after another, so a phase
    that ends before it starts, or overlaps an earlier one, is no phase that ran (the exports would draw it
    with a negative length)."""
    ended: "float | None" = None  # the latest end of the phases before
    for s in steps:
        for p in s.phases:
            where = f"step {p.step}'s {p.phase.value}" + (f" #{p.occurrence}" if p.occurrence else "") + " phase"
            start, peak, end = p.start_us, p.peak_us, p.end_us
            if start is not None and end is not None and end < start:
                raise corrupt(f"{where} ends ({end} microseconds) before it starts ({start})")
            if peak is not None and ((start is not None and peak < start) or (end is not None and peak > end)):
                raise corrupt(f"{where} peaks at {peak} microseconds, outside its start ({start}) and end ({end})")
            if start is not None and ended is not None and start < ended:
                raise corrupt(f"{where} starts ({start} microseconds) before the phases recorded before it "
                              f"ended ({ended})")
            times = [t for t in (start, peak, end) if t is not None]
            if times:
                ended = max([*times, ended] if ended is not None else times)


def _modules(items: object) -> tuple[ModuleRecord, ...]:
    """The module table: one record per module, by its path."""
    modules = tuple(ModuleRecord.from_dict(m) for m in seq(items, "modules"))
    listed_once((m.path for m in modules), "a module")
    return modules


def _live_modules(data: Mapping[str, object]) -> tuple[tuple[str, int], ...]:
    """What each module's calls left live at the error: each module once."""
    rows = tuple((text(a, "a module path"), count(b, "a module's bytes"))
                 for a, b in _rows(data, "live_modules_at_error", 2))
    listed_once((path for path, _ in rows), "a module live at the error")
    return rows


def _phase_stats(data: Mapping[str, object]) -> tuple[PhaseStats, ...]:
    """The per-phase statistics: one per kind of phase (phase, occurrence)."""
    stats = tuple(PhaseStats.from_dict(p) for p in _list(data, "phase_stats"))
    listed_once((f"{p.phase.value} #{p.occurrence}" for p in stats), "a phase's statistics")
    return stats


def _consistent(t: "Trace", *, stated_steps: bool) -> None:
    """What ties a trace's parts together: each list in its order, each cross-reference to something the trace
    holds. Where the file says how many steps ran (schema 3 and later), everything numbered by step is among them."""
    if stated_steps:
        _among_steps_run(t, t.num_steps)
    if t.peak.total is not None:
        higher = [b.total for b in (t.start, t.end) if b.total is not None and b.total > t.peak.total]
        if higher:
            raise corrupt(f"the run's peak ({t.peak.total} bytes) is below its start or end ({max(higher)})")
    _timeline_in_order(t.timeline)
    _peak_is_where_it_says(t)
    _modules_named_are_listed(t)
    _spans_in_order(t.recorded_steps, t)
    _stats_numbered(t.phase_stats)
    if t.generation is not None:
        kept = {(s.index, p.phase.value, p.occurrence) for s in t.steps for p in s.phases}
        indices = {s.index for s in t.steps}
        for key in t.generation.phase_keys():
            if key[0] in indices and key not in kept:
                raise corrupt(f"the generation record speaks of step {key[0]}'s {key[1]} #{key[2]}, which step "
                              f"{key[0]} does not hold")
    if t.operations is not None:
        listed_once(((o.phase, o.cls, o.op) for o in t.operations), "an operation")


def steps_held(t: "Trace") -> int:
    """The steps a trace that does not say how many ran must have had (schema 1 and 2 files kept every step): as
    many as it holds, and at least up to the last step it names (a kept step, a sample, the peak ...) and as many
    as its statistics count, so that re-saving it states a count its own parts agree with."""
    named = [step + ran for _, step, ran in _steps_named(t)]
    most = max((p.count for p in t.phase_stats), default=0)
    return max([len(t.steps), most, *named])


def _steps_named(t: "Trace") -> "list[tuple[str, int, int]]":
    """Each step the trace names (the latest of each ordered list), what names it, and 1 if that step ran (a kept
    step), else 0: a sample, the peak, a stretch of recorded steps, an optimizer step or the generation record may
    also name the step in progress when the profile ended, which is no step that ran (``num_steps`` counts those
    that did), as a profile that ends before its first step has a sample of step 0 and a generation's cache still
    held after the last step ends has a moment of the next."""
    named = [(f"step {s.index} is recorded", s.index, 1) for s in t.steps[-1:]]
    named += [(f"the timeline holds a sample of step {s.step}", s.step, 0) for s in t.timeline[-1:]]
    named += [(f"peak_step is {t.peak_step}", t.peak_step, 0)] if t.peak_step is not None else []
    named += [(f"the recorded steps end at step {b}", b, 0) for _, b in t.recorded_steps[-1:]]
    named += [(f"the optimizer steps end at step {b}", b, 0) for _, b, _ in t.optimizer_steps[-1:]]
    if t.generation is not None:
        named += [(f"the generation record speaks of step {k[0]}", k[0], 0) for k in t.generation.phase_keys()]
    return named


def _among_steps_run(t: "Trace", n: int) -> None:
    """Every step the trace names is one of the steps the run had (or the one in progress when it ended), and
    every kind of phase was counted in at least one step and at most in each."""
    for what, step, ran in _steps_named(t):
        if step + ran > n:
            raise corrupt(f"{what} but the run had {n} steps")
    for p in t.phase_stats:
        if not 1 <= p.count <= n:
            raise corrupt(f"the statistics of {p.phase.value} #{p.occurrence} count {p.count} phases, in a run of "
                          f"{n} steps (one a step at most, at least one)")


def _timeline_in_order(samples: "tuple[Sample, ...]") -> None:
    """Samples in the order they were taken: numbered upwards, their steps and times never going back."""
    for a, b in zip(samples, samples[1:]):
        if b.seq <= a.seq:
            raise corrupt(f"timeline sample {b.seq} is listed after sample {a.seq}")
        if b.step < a.step:
            raise corrupt(f"timeline sample {b.seq} (step {b.step}) is listed after sample {a.seq} of step {a.step}")
        if a.time_us is not None and b.time_us is not None and b.time_us < a.time_us:
            raise corrupt(f"timeline sample {b.seq} ({b.time_us} microseconds) is listed after sample {a.seq} "
                          f"({a.time_us})")


def _tensor_bytes(b: Breakdown, categories: tuple[Category, ...]) -> "int | None":
    """The bytes of ``categories`` (tensor categories: the ledger's, without what a device adds), None if one of
    them is not measured."""
    values = [b[c] for c in categories]
    return None if any(v is None for v in values) else sum(cast(int, v) for v in values)


def _peak_is_where_it_says(t: "Trace") -> None:
    """The peak's step and phase are given together. In exact mode the ledger's peak is the first moment the
    highest total was reached, so no phase peaks above it and the first phase (in the order they ran) to reach it
    is the one the peak's step and phase name; compared on the tensor categories, which the ledger counts (a
    device's own rows are read at each phase's end)."""
    if (t.peak_step is None) != (t.peak_phase is None):
        raise corrupt(f"peak_step is {t.peak_step} but peak_phase is "
                      f"{t.peak_phase.value if t.peak_phase is not None else None}: the peak's step and phase "
                      "are given together")
    # The tensor categories the run's peak measured (a file older than the KV cache's has no figure for it).
    categories = tuple(c for c in TENSOR_CATEGORIES if t.peak[c] is not None)
    peak = _tensor_bytes(t.peak, categories)
    if t.mode != "exact" or not categories or peak is None or t.peak_step is None or t.peak_phase is None:
        return  # light mode's ledger sees no temporaries: its peak need not be its phases' highest
    first = None
    for p in t.phases:
        own = _tensor_bytes(p.peak, categories)
        if own is not None and own > peak:
            raise corrupt(f"step {p.step}'s {_label(p)} peaks at {own} bytes of tensors, above the run's peak "
                          f"({peak})")
        if own == peak and first is None:
            first = p
    said = f"the peak ({peak} bytes of tensors) is said to be in step {t.peak_step}'s {t.peak_phase.value}"
    step = next((s for s in t.steps if s.index == t.peak_step), None)
    if step is None:  # not kept: no kept phase before it reached the peak
        if first is not None and first.step < t.peak_step:
            raise corrupt(f"{said}, but step {first.step}'s {_label(first)} reached it first")
        return
    named = [p for p in step.phases if p.phase is t.peak_phase]
    if not named:
        raise corrupt(f"{said}, which step {step.index} does not hold")
    if first is not None and (first.step, first.phase) != (step.index, t.peak_phase):
        raise corrupt(f"{said}, but step {first.step}'s {_label(first)} reached it first")
    known = [b for p in named if (b := _tensor_bytes(p.peak, categories)) is not None]
    if first is None and len(known) == len(named):
        raise corrupt(f"{said}, whose highest peak is {max(known)} bytes")


def _label(p: PhaseRecord) -> str:
    return f"{p.phase.value}" + (f" #{p.occurrence}" if p.occurrence else "") + " phase"


def _modules_named_are_listed(t: "Trace") -> None:
    """Every module the trace names (the peak's, each one's parent, those live at the error, those that held a
    live storage or routed tokens) is in its module table, where it has one (a simulation's may be empty)."""
    if not t.modules:
        return
    paths = {m.path for m in t.modules}
    named = [(f"module {m.path[:40]!r} is listed but its parent", parent_path(m.path))
             for m in t.modules if parent_path(m.path)]
    named += [("peak_module", t.peak_module)] if t.peak_module is not None else []
    named += [("a module live at the error", path) for path, _ in t.live_modules_at_error]
    named += [("a live storage's module", row[3]) for row in t.live_storages_at_error if row[3]]
    if t.routing is not None:
        named += [("a router call's module", c.module) for c in t.routing.calls if c.module]
    for what, path in named:
        if path not in paths:
            raise corrupt(f"{what} {path[:40]!r} is not in the module table")


def _spans_in_order(spans: tuple[tuple[int, int], ...], t: "Trace") -> None:
    """The stretches of recorded steps one after another, and every kept step in one of them."""
    for (_, b), (c, d) in zip(spans, spans[1:]):
        if c <= b:
            raise corrupt(f"a stretch of recorded steps {c}-{d} begins before the one before it ended ({b})")
    if spans:
        outside = [s.index for s in t.steps if not any(a <= s.index <= b for a, b in spans)]
        if outside:
            raise corrupt(f"step {outside[0]} is kept but no stretch of recorded steps holds it")


def _stats_numbered(stats: tuple[PhaseStats, ...]) -> None:
    """Each kind of phase's statistics numbered 0, 1, 2 ..., each counting no more phases than the one before
    (a step holds a kind's #1 only after its #0)."""
    counts = {(p.phase, p.occurrence): p.count for p in stats}
    for p in stats:
        if p.occurrence:
            before = counts.get((p.phase, p.occurrence - 1))
            if before is None or before < p.count:
                raise corrupt(f"the statistics count {p.count} {p.phase.value} #{p.occurrence} phases but "
                              f"{before or 0} {p.phase.value} #{p.occurrence - 1}")


def _peak_step(data: Mapping[str, object]) -> "int | None":
    step = optional_count(data.get("peak_step"), "peak_step")
    # Iterated as it stands: a "steps" that is no list is refused by _steps, or its TypeError here becomes corrupt.
    indices = [s.get("index") for s in cast("Iterable[object]", data.get("steps", ())) if isinstance(s, Mapping)]
    ints = [i for i in indices if isinstance(i, int)]
    if step is not None and indices and len(ints) == len(indices) and step > max(ints):
        raise corrupt(f"peak_step {step} is after the last step recorded ({max(ints)})")
    return step


def parent_path(path: str) -> str:
    """The path of a module's parent in the model's tree ("" for the root's children and the root)."""
    return path.rpartition(".")[0]


class HoldsTrace(Protocol):
    """Anything holding a Trace as ``.trace``: a :class:`~memprof.Report` (a layer above record), an Estimate."""

    @property
    def trace(self) -> Trace: ...


class HoldsPeak(Protocol):
    """Anything with a peak breakdown: a Trace, a :class:`~memprof.Report` (a layer above record), an Estimate."""

    @property
    def peak(self) -> Breakdown: ...


#: What the public functions that read a run take: a Trace, a Report (anything holding a Trace as ``.trace``) or
#: the path of a saved trace.
TraceSource = Trace | HoldsTrace | str | os.PathLike[str]


def as_trace(obj: object) -> Trace:
    """The Trace of a Report, or the Trace itself; anything else is refused with a clear error."""
    from ..errors import InvalidArgumentError

    trace = getattr(obj, "trace", obj)
    if not isinstance(trace, Trace):
        raise InvalidArgumentError(
            f"expected a memprof Report or Trace, got {type(obj).__name__}; use prof.report() or memprof.load(path)"
        )
    return trace
