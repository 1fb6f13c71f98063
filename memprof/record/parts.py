"""The pieces of the record: a breakdown by category, and the records of phases, steps, modules,
timeline samples, the device and an out-of-memory error. :mod:`memprof.record.trace` assembles them into the
Trace (and re-exports them: import them from there).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from ..vocabulary import TENSOR_CATEGORIES, Category, Phase
from .cache import CacheMoment, frozen_spec, spec_data
from .aliases import JSONObject, Setting
from .layout import MeshLayout
from . import fields as fileform
from .fields import form
from .checks import (MAX_COUNT, corrupt, count, listed_once, member, optional_count, optional_time,
                     pairs, seq, text)
from ..errors import TraceFormatError

__all__ = ["Breakdown", "PhaseRecord", "StepRecord", "ModuleRecord", "Sample", "SAMPLE_EVENTS", "OomRecord",
           "DeviceInfo", "ModelFacts", "OperationRecord", "GenerationFacts",
           "RankInfo", "MAX_WORLD"]

_ALL = tuple(Category)
_TENSOR = tuple(_ALL.index(c) for c in TENSOR_CATEGORIES)
_tensors = operator.itemgetter(*_TENSOR)  # a breakdown's tensor categories' counts, as a tuple
_NAMES = tuple(c.value for c in _ALL)  # read once: an enum's .value is a property, and files hold millions
# A category's place in a breakdown, by member or by value (a str enum's member and its value are one key).
_INDEX: dict[str, int] = {c: i for i, c in enumerate(_ALL)}  # by Category, which is a str, and by value
#: What a file's count may be: an int (never a bool, a subclass) or None (not measured).
_COUNT_TYPES = frozenset({int, type(None)})


def _plain_counts(values: "tuple[object, ...]", total: object) -> bool:
    """Is each of ``values`` and ``total`` None or an int within :data:`~memprof.record.checks.MAX_COUNT`? The
    same rule as :func:`~memprof.record.checks.optional_count`, in a few C calls: a trace file holds hundreds of
    thousands of breakdowns, and checking each count by a Python call took most of loading one."""
    if not _COUNT_TYPES.issuperset(map(type, values)) or type(total) not in _COUNT_TYPES:
        return False
    known = [v for v in (*values, total) if isinstance(v, int)]  # ints, every one not None: the types are checked
    return not known or (min(known) >= 0 and max(known) <= MAX_COUNT)

#: The most ranks a job may have, in a record or an estimate: larger worlds than any job runs, so a
#: typo (or a crafted file) more likely than a plan; what is sized per rank stays bounded.
MAX_WORLD = 1 << 20


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
    def from_mapping(cls, values: "Mapping[Category, int | None] | Mapping[str, int | None]",
                     total: "int | None" = None, *, compute_total: bool = True) -> "Breakdown":
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
        i = _INDEX.get(key) if isinstance(key, str) else None
        return self.counts[i if i is not None else _ALL.index(Category.parse(key))]

    def __iter__(self) -> Iterator[Category]:
        return iter(_ALL)

    def __len__(self) -> int:
        return len(_ALL)

    @property
    def tensor_bytes(self) -> int:
        """The bytes of the tensor categories (the device-level ones left out), one not measured counted as 0:
        what a simulated peak is (:attr:`memprof.Estimate.peak_bytes`) and what a phase's moments compare."""
        return sum(v or 0 for v in _tensors(self.counts))

    def measured(self) -> dict[Category, int]:
        """Only the categories that were measured."""
        return {c: v for c, v in zip(_ALL, self.counts) if v is not None}

    # Written by hand, not from its fields (record/fields.py): its file form is a mapping of each category's
    # value to its bytes, not its ``counts`` tuple, and reading it checks the categories against the total.
    def to_dict(self) -> JSONObject:
        out: JSONObject = dict(zip(_NAMES, self.counts))
        out["total"] = self.total
        return out

    @classmethod
    def from_dict(cls, data: object) -> "Breakdown":
        """Read from a file: bytes per category and the total, which must agree as a measurement does
        (the measured categories sum to the total when every tensor category is measured, and never
        exceed it when some are not)."""
        if type(data) is not dict and not isinstance(data, Mapping):  # a file's are dicts: typing's check is slow
            raise corrupt(f"a breakdown must be a mapping of category to bytes, got {type(data).__name__}")
        values = tuple(map(data.get, _NAMES))
        total = data.get("total")
        if not _plain_counts(values, total):  # the check that names the field and the fix, only where one fails
            values = tuple(optional_count(v, name) for v, name in zip(values, _NAMES))
            total = optional_count(total, "total")
        if total is not None:
            known = sum(filter(None, values))  # None and 0 add nothing
            complete = None not in _tensors(values)
            if known > total or complete and known != total:
                raise corrupt(f"a breakdown's categories sum to {known} bytes but its total is {total}")
        return cls(values, total)

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

    step: int = field(metadata=form(label="step"))
    phase: Phase = field(metadata=form(label="a phase"))
    occurrence: int = field(metadata=form(label="occurrence"))
    start: Breakdown
    peak: Breakdown
    end: Breakdown
    ops: int = field(default=0, metadata=form(label="ops"))
    #: Bytes of named kinds of saved tensors (dropout masks, norm statistics, ...) at the peak and end.
    tags_peak: tuple[tuple[str, int], ...] = field(default=(), metadata=form(read=lambda v, _: pairs(v)))
    tags_end: tuple[tuple[str, int], ...] = field(default=(), metadata=form(read=lambda v, _: pairs(v)))
    #: When the phase began, reached its peak and ended: microseconds since the profile started
    #: (schema 4; None in older files). The time axis of the Chrome/Perfetto and memory_viz exports.
    #: Not compared: two records of the same memory are equal however long they took.
    start_us: "float | None" = field(default=None, compare=False,
                                     metadata=form(label="a phase's start_us", read=optional_time))
    peak_us: "float | None" = field(default=None, compare=False,
                                    metadata=form(label="a phase's peak_us", read=optional_time))
    end_us: "float | None" = field(default=None, compare=False,
                                   metadata=form(label="a phase's end_us", read=optional_time))

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "PhaseRecord":
        rec = fileform.read(cls, data, "a phase")
        _peak_is_highest(rec.peak, (rec.start, rec.end), f"step {rec.step}'s {rec.phase.value} phase")
        return rec


def _peak_is_highest(peak: Breakdown, others: tuple[Breakdown, ...], where: str) -> None:
    """A peak is the highest total of its span, so no moment of it (its start, its end) is higher."""
    if peak.total is None:
        return
    higher = [b.total for b in others if b.total is not None and b.total > peak.total]
    if higher:
        raise corrupt(f"{where} peaks at {peak.total} bytes, below its own start or end ({max(higher)})")


@dataclass(frozen=True)
class ModelFacts:
    """What the reconciler needs to know about the model, measured on the live objects at exit.

    Counts are of unique parameters (tied weights once). A trace records what a
    formula needs (:attr:`Trace.module_calls`, :attr:`Trace.optimizers`) and
    :mod:`memprof.anatomy.predict` computes the formulas downstream; the
    ``*_formula`` fields hold them where that record is not the run's: traces of
    schema 1, where the collector computed them (with ``modules_without_rule``),
    and an estimate extended in depth, whose module calls and optimizers are the
    cut model's (:mod:`memprof.simulate.depth` extends the cuts' formulas in a
    line). Where set, they are the formulas.
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
    #: Of ``activation_formula``, what modules under torch.utils.checkpoint would save (set with it by an
    #: estimate extended in depth; schema 1 traces have none).
    activation_checkpointed_formula: "int | None" = None
    #: Bytes of the model's inputs (storages made before the profile: the batch, token ids) that modules
    #: with a saved-bytes rule saved in the first forward. Their rules count them as activations; the
    #: measurement counts them as inputs. ``None`` when no forward was seen.
    activation_inputs_saved: "int | None" = None
    modules_without_rule: tuple[str, ...] = field(default=(), metadata=form(label="a module type"))
    #: (module path, attribute, value) of Linear/Conv/Embedding dimensions, for the alignment advice.
    dims: tuple[tuple[str, str, int], ...] = field(default=(), metadata=form(label="a dimension"))
    #: First dimension of the model's first input in the first forward.
    batch_size: "int | None" = None

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "ModelFacts":
        return fileform.read(cls, data, "a ModelFacts")


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

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "OperationRecord":
        return fileform.read(cls, data, "an operation record")


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step (or one ``prof.step()`` block) and its phases, in order."""

    index: int = field(metadata=form(label="a step's index"))
    phases: tuple[PhaseRecord, ...] = field(metadata=form(label="a step's phases"))

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "StepRecord":
        """Read from a file: at least one phase (a step is kept only once one was recorded), each its own, each
        (phase, occurrence) once, and each kind numbered 0, 1, 2 ... without a gap (the collector counts a
        step's phases of a kind from 0: a lone ``backward #3`` is no step that ran)."""
        step = fileform.read(cls, data, "a step")
        index, phases = step.index, step.phases
        if not phases:
            raise corrupt(f"step {index} holds no phase")
        seen: dict[Phase, set[int]] = {}
        for p in phases:
            if p.step != index:
                raise corrupt(f"step {index} holds a phase of step {p.step}")
            if p.occurrence in seen.setdefault(p.phase, set()):
                raise corrupt(f"step {index} holds {p.phase.value} #{p.occurrence} twice")
            seen[p.phase].add(p.occurrence)
        for kind, numbers in seen.items():
            # Numbered in the order they ran, but a forward found afterwards to have been a prefill takes the next
            # prefill number: the set, not the order, is what every step memprof writes has.
            if max(numbers) >= len(numbers):
                gap = min(set(range(len(numbers))) - numbers)
                raise corrupt(f"step {index} holds {kind.value} #{max(numbers)} but no {kind.value} #{gap} (a step's "
                              "phases of one kind are numbered 0, 1, 2 ...)")
        return step


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

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "ModuleRecord":
        return fileform.read(cls, data, "a ModuleRecord")


@dataclass(frozen=True)
class Sample:
    """One point of the memory timeline, taken at a module or phase boundary.

    ``event`` says which boundary: "start" (the profile's), "phase" (``label`` is the phase that
    began), "enter" or "exit" (``label`` is a module's path; in backward, its gradient's computation);
    "" in files older than schema 4, which also have no ``time_us``.
    """

    seq: int = field(metadata=form(label="a sample's seq"))
    step: int = field(metadata=form(label="a sample's step"))
    phase: Phase = field(metadata=form(label="a sample's phase"))
    label: str = field(metadata=form(label="a sample's label"))
    breakdown: Breakdown
    #: Microseconds since the profile started (not compared, as a phase's times).
    time_us: "float | None" = field(default=None, compare=False,
                                    metadata=form(label="a sample's time_us", read=optional_time))
    # _event is defined below the class, beside SAMPLE_EVENTS: called through a lambda.
    event: str = field(default="", metadata=form(label="a sample's event", read=lambda v, n: _event(v, n)))

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "Sample":
        """Read from a file: a sample that marks a phase's beginning is labelled with that phase."""
        sample = fileform.read(cls, data, "a timeline sample")
        if sample.event == "phase" and sample.label != sample.phase.value:
            raise corrupt(f"timeline sample {sample.seq} marks the beginning of {sample.phase.value} but is labelled "
                          f"{sample.label[:40]!r}")
        return sample


#: What a timeline sample marks (see :class:`Sample`).
SAMPLE_EVENTS = ("", "start", "phase", "enter", "exit")


def _event(value: object, name: str) -> str:
    event = text(value, name)
    if event not in SAMPLE_EVENTS:
        raise corrupt(f"{name} must be one of {', '.join(map(repr, SAMPLE_EVENTS))}, got {event[:20]!r}")
    return event


@dataclass(frozen=True)
class OomRecord:
    """An out-of-memory error that ended the profile (``profile(..., oom_dump=...)`` writes the trace).

    ``requested`` is the allocation that failed, ``device_free`` and ``device_total`` what the device
    reported at that moment (None where unknown: CPU, or a message that did not say). ``snapshot`` is
    the memory_viz snapshot written beside the dump (CUDA with memory history recorded), if any.
    """

    message: str = field(metadata=form(label="the OOM message"))
    requested: "int | None" = field(default=None, metadata=form(label="requested"))
    device_free: "int | None" = field(default=None, metadata=form(label="device_free"))
    device_total: "int | None" = field(default=None, metadata=form(label="device_total"))
    snapshot: "str | None" = field(default=None, metadata=form(label="the OOM snapshot"))

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "OomRecord":
        return fileform.read(cls, data, "the OOM record")


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

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "DeviceInfo":
        return fileform.read(cls, data, "a DeviceInfo")


@dataclass(frozen=True)
class RankInfo:
    """The rank a run was in a torch.distributed job (schema 5): its rank, the world size, the backend and
    the parallel layout of the model (``ddp``, ``fsdp2``, ``fsdp1``, ``deepspeed``; None when unwrapped)."""

    rank: int = field(metadata=form(label="a rank"))
    world_size: int = field(metadata=form(label="a world size"))
    backend: "str | None" = field(default=None, metadata=form(label="backend"))
    layout: "str | None" = field(default=None, metadata=form(label="layout"))
    #: DDP's gradient_as_bucket_view: the gradients are the buckets (no copy); None for other layouts.
    bucket_view: "bool | None" = field(default=None, metadata=form(label="bucket_view"))
    #: FSDP2: this rank's shards of every parameter, with the padding FSDP adds so that dim 0 divides by
    #: the world size; the bytes of that padding; and the parameters' full (unsharded) bytes in the dtype
    #: they are gathered in. None for other layouts.
    sharded_bytes: "int | None" = field(default=None, metadata=form(label="sharded bytes"))
    padding_bytes: "int | None" = field(default=None, metadata=form(label="padding bytes"))
    unsharded_bytes: "int | None" = field(default=None, metadata=form(label="unsharded bytes"))
    #: FSDP2: the bytes an even split of its parameters would give each rank (no padding, no uneven rows).
    even_bytes: "int | None" = field(default=None, metadata=form(label="even bytes"))
    #: The rank's share of the model's parameters (and of the trainable ones), in elements: each DTensor
    #: parameter counts its global size over the number of shards its placements make (FSDP, HSDP's shard
    #: dimension, tensor parallelism), any other parameter whole. None when no parameter is a DTensor.
    params_per_rank: "int | None" = field(default=None, metadata=form(label="params per rank"))
    trainable_per_rank: "int | None" = field(default=None, metadata=form(label="trainable per rank"))
    #: Into how many shards every parameter is cut, when that is the same for all (FSDP: the world size;
    #: HSDP: its shard dimension); None when it differs or no parameter is a DTensor.
    shards: "int | None" = field(default=None, metadata=form(label="shards"))
    #: The device mesh, the dimensions that cut each group of parameters and FSDP2's policy, read from the
    #: parameters at profile time; None when no parameter is a DTensor.
    layout_detail: "MeshLayout | None" = None

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "RankInfo":
        """Read from a file: a world of 1 to :data:`MAX_WORLD` ranks, holding the rank."""
        info = fileform.read(cls, data, "the rank record")
        if not 1 <= info.world_size <= MAX_WORLD:
            raise corrupt(f"a world size must be between 1 and {MAX_WORLD:,} ranks, got {info.world_size}")
        if info.rank >= info.world_size:
            raise corrupt(f"rank {info.rank} does not exist in a world of {info.world_size}")
        return info


@dataclass(frozen=True)
class GenerationFacts:
    """What the cache formulas need of a run that decoded with a cache (schema 5).

    The model's shape (from its transformers-style ``config``: layers, key/value heads, head dimension,
    a sliding window if any; ``None`` where it has no such config) and its cache per layer (``cache``),
    the element size of its keys and values and the batch as the run had them, and the tokens in the
    cache after each prefill and decode phase, as ``(step, phase, occurrence, tokens)``.
    """

    layers: "int | None" = field(default=None, metadata=form(label="layers"))
    kv_heads: "int | None" = field(default=None, metadata=form(label="kv_heads"))
    head_dim: "int | None" = field(default=None, metadata=form(label="head_dim"))
    sliding_window: "int | None" = field(default=None, metadata=form(label="sliding_window"))
    itemsize: "int | None" = field(default=None, metadata=form(label="itemsize"))
    batch: "int | None" = field(default=None, metadata=form(label="batch"))
    tokens: tuple[tuple[int, str, int, int], ...] = field(default=(), metadata=form(read=lambda v, _: _tokens(v)))
    #: The model's cache per layer (``memprof.anatomy.CacheSpec.to_dict()``, from its config, kept as
    #: (name, value) pairs: ``dict(cache)``); None when memprof could not read one (older files: the
    #: fields above describe a uniform attention cache).
    #: In the file: the spec's mapping, its tuples as lists.
    cache: "tuple[tuple[str, Setting], ...] | None" = field(default=None, metadata=form(
        read=lambda v, _: frozen_spec(spec_data(v)),
        write=lambda v: None if v is None else {k: list(x) if isinstance(x, tuple) else x for k, x in v}))
    #: The encoder's tokens of an encoder-decoder model; the length a static cache was allocated at.
    encoder_tokens: "int | None" = field(default=None, metadata=form(label="encoder_tokens"))
    max_cache_len: "int | None" = field(default=None, metadata=form(label="max_cache_len"))
    #: The cache at each prefill and decode phase's peak and end (older files: none), each a positional list.
    moments: tuple[CacheMoment, ...] = field(default=(), metadata=form(
        read=lambda v, _: tuple(CacheMoment.from_list(m) for m in seq(v, "moments")),
        write=lambda v: [m.to_list() for m in v]))
    #: (step, occurrence) of each prefill that began with an encoder-decoder model's encoder (the encoder's
    #: output is made in it, so the prefill begins without it; older files: none, their prefills began at the
    #: decoder's call with the encoder's output already there).
    encoder_prefills: tuple[tuple[int, int], ...] = field(default=(), metadata=form(label="an encoder's prefill"))

    def tokens_at(self, step: int, phase: str, occurrence: int) -> "int | None":
        """Tokens in the cache at the end of that phase; after the last per-token decode phase, its count."""
        for s, p, o, n in self.tokens:
            if (s, p, o) == (step, phase, occurrence):
                return n
        return None

    def __post_init__(self) -> None:
        if isinstance(self.cache, Mapping):  # given as CacheSpec.to_dict() gives it
            object.__setattr__(self, "cache", frozen_spec(self.cache))

    def moment(self, step: int, phase: str, occurrence: int, moment: str) -> "CacheMoment | None":
        """The cache's record at the ``"peak"`` or ``"end"`` of that phase, if the run made one."""
        return next((m for m in self.moments if m.key() == (step, phase, occurrence, moment)), None)

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "GenerationFacts":
        """Read from a file: each phase's token count, each moment and each encoder's prefill once, and every
        phase named as memprof names one (what they refer to is checked by the Trace that holds them)."""
        facts = fileform.read(cls, data, "the generation record")
        for m in facts.moments:
            member(m.phase, Phase, "a cache moment's phase")
        listed_once((t[:3] for t in facts.tokens), "a phase's token count")
        listed_once((m.key() for m in facts.moments), "a cache moment")
        listed_once(facts.encoder_prefills, "an encoder's prefill")
        return facts

    def phase_keys(self) -> "Iterator[tuple[int, str, int]]":
        """The (step, phase, occurrence) of every phase this record says something of."""
        yield from (t[:3] for t in self.tokens)
        yield from (m.key()[:3] for m in self.moments)
        yield from ((s, Phase.PREFILL.value, o) for s, o in self.encoder_prefills)


def _tokens(items: object) -> tuple[tuple[int, str, int, int], ...]:
    """A generation's token counts from a file: (step, phase, occurrence, tokens), the phase as memprof names one."""
    rows = (seq(t, "a token count", 4) for t in seq(items, "tokens"))
    return tuple((count(s, "a step"), member(p, Phase, "a token count's phase").value, count(o, "an occurrence"),
                  count(n, "a token count")) for s, p, o, n in rows)
