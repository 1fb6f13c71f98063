"""What a CUDA device holds for a run, beyond its tensors: the caching allocator's cache and the memory
outside torch.

A simulation for a CUDA target (and a measured run that asked for it, ``record_allocations=True``) keeps its
allocation stream: every storage made, resized and freed, in order (:meth:`memprof.collect.ledger.Ledger.
record_stream`). :func:`device_memory` replays that stream through the model of torch's CUDA caching allocator
(:class:`memprof.anatomy.allocator.CachingAllocator`, with the run's ``PYTORCH_CUDA_ALLOC_CONF``), with the
cuBLAS workspaces, which are blocks of that allocator, allocated where a step first multiplies; and adds what
lives outside the allocator (the CUDA context, NCCL communicators: :mod:`memprof.anatomy.outside`). At each
recorded moment ``allocator_overhead`` is the model's reserved bytes less the tensors', and ``outside_torch``
the outside terms; the device-level peak is the replay's peak reserved plus the outside terms.
"""

from __future__ import annotations

import dataclasses
import os
import re
import uuid
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ..anatomy.alloc_config import AllocatorConfig
from ..anatomy.allocator import CachingAllocator
from ..anatomy.gpus import GpuSpec, gpu as gpu_by_name
from ..anatomy.outside import (OutsideTerm, cublas_workspace_bytes, cublas_workspaces, cublaslt_workspace_bytes,
                                cuda_context, cudnn_workspace, nccl_communicator)
from ..collect.weak import WeakValues
from ..errors import InvalidArgumentError, is_interrupt
from ..record.trace import Breakdown, DeviceInfo, Trace
from ..vocabulary import TENSOR_CATEGORIES, Phase
from .alloc_stream import check_stream, from_start, replay_stream

if TYPE_CHECKING:
    from ..collect.simulated import RecordedStream

__all__ = ["DeviceMemory", "Replay", "replay_of", "device_memory", "resolve_gpu", "resolve_conf", "outside_terms",
           "replay_stream", "STREAM_UNKNOWN_GPU_CC"]

#: Without a GPU the workspaces are sized for the larger of torch's defaults: Hopper and Blackwell's 32 MiB
#: (compute capability 9.0 and up, ``CublasHandlePool.cpp``), so that no GPU is under-estimated.
STREAM_UNKNOWN_GPU_CC = (9, 0)
_N = len(TENSOR_CATEGORIES)


@dataclass(frozen=True)
class DeviceMemory:
    """The device-level figures of one run on one (simulated) CUDA device, in bytes.

    ``peak_reserved`` is the replay's highest reserved bytes (tensors, cuBLAS workspaces and the allocator's
    cache); ``outside_bytes`` the terms outside the allocator; ``device_peak`` their sum, what nvidia-smi
    would show at the peak. ``capacity`` is the GPU's (``GpuSpec.allocatable_bytes``), None without a GPU:
    then ``fits`` and ``headroom`` are None. ``fits`` is False where the replay, capped at what the device
    leaves the allocator, predicts an out-of-memory error (``oom`` says where), even after torch frees its
    cache and retries. ``terms`` are every term with its source, the workspaces (in the replay) included.
    """

    gpu: "GpuSpec | None"
    alloc_conf: str
    terms: tuple[OutsideTerm, ...]
    peak_allocated: int
    peak_reserved: int
    outside_bytes: int
    segments: int
    capacity: "int | None" = None
    oom: "str | None" = None
    num_alloc_retries: int = 0
    #: The run's peak breakdown with the modelled device rows (set for a measured run's replay).
    peak: "Breakdown | None" = None
    #: A measured CUDA run's own figures (``torch.cuda.memory_reserved`` and NVML's outside-torch bytes at its
    #: end), beside the model's; None elsewhere.
    measured_reserved: "int | None" = None
    measured_outside: "int | None" = None
    #: Names the :class:`Replay` a simulation's record came from, so that every copy of the record (the facade's
    #: that the public ``memprof.estimate`` returns, ``dataclasses.replace``) finds it (:func:`replay_of`); a plain
    #: string, so that the record stays plain data. None for a measured run's figures.
    replay_id: "str | None" = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        replay = _REPLAYS.get(self.replay_id) if self.replay_id is not None else None
        if replay is not None:
            # A strong reference: the replay lives as long as some record of it (the registry's are weak).
            object.__setattr__(self, "_replay", replay)

    @property
    def device_peak(self) -> int:
        return self.peak_reserved + self.outside_bytes

    @property
    def workspace_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.through_allocator)

    @property
    def allocator_limit(self) -> "int | None":
        """What ``per_process_memory_fraction`` lets the allocator reserve: torch's ``allowed_memory_maximum``,
        ``int(fraction * totalGlobalMem)`` (``setMemoryFraction``); None without a fraction below 1 or a GPU."""
        fraction = fraction_in(self.alloc_conf)
        if self.capacity is None or fraction is None or fraction >= 1:
            return None
        return int(fraction * self.capacity)

    @property
    def fits(self) -> "bool | None":
        if self.capacity is None:
            return None
        limit = self.allocator_limit
        return (self.oom is None and self.device_peak <= self.capacity
                and (limit is None or self.peak_reserved <= limit))

    @property
    def headroom(self) -> "int | None":
        """``capacity - device_peak`` (negative when it does not fit), or less where a memory fraction caps the
        allocator below it (:attr:`allocator_limit` - ``peak_reserved``); None without a GPU."""
        if self.capacity is None:
            return None
        limit = self.allocator_limit
        room = self.capacity - self.device_peak
        return room if limit is None else min(room, limit - self.peak_reserved)

    def outside_split(self) -> "list[tuple[str, int]] | None":
        """A measured run's outside-torch bytes split into the terms known here: NCCL's buffers by their formula,
        the CUDA context up to its published ceiling, and what neither explains; None when not measured."""
        if self.measured_outside is None:
            return None
        left = self.measured_outside
        rows = []
        for name in ("nccl", "cuda_context"):
            for t in self.terms:
                if t.name == name and not t.through_allocator:
                    part = min(left, t.bytes)
                    rows.append((name, part))
                    left -= part
        rows.append(("unexplained", left))
        return rows

    def notes(self) -> list[str]:
        out = [f"device memory: the allocation stream replayed through a model of torch's CUDA caching allocator "
               f"(c10/cuda/CUDACachingAllocator.cpp) with PYTORCH_CUDA_ALLOC_CONF={self.alloc_conf or '(unset)'}: "
               f"peak reserved {self.peak_reserved} B in {self.segments} segment(s) at the end; "
               "allocator_overhead = reserved - tensor bytes (cached free blocks, rounding, and the workspaces "
               "below, which are allocator blocks but no tensor)"]
        for t in self.terms:
            where = "in the replay (an allocator block)" if t.through_allocator else "outside torch"
            out.append(f"{t.name} {t.bytes} B, {where}: {t.assumption} [{t.source}]")
        fraction = fraction_in(self.alloc_conf)
        if fraction is not None and fraction < 1:
            if self.capacity is None:
                out.append(f"per_process_memory_fraction {fraction}: not applied, since no GPU was given to take the "
                           "fraction of (give gpu=); the figures are those of an allocator the fraction does not cap, "
                           "which reserves at least as much")
            else:
                out.append(f"per_process_memory_fraction {fraction}: the allocator may reserve at most "
                           f"{int(fraction * self.capacity)} B of the device's {self.capacity} B (torch's "
                           "allowed_memory_maximum = fraction x totalGlobalMem, checked in alloc_block before each new "
                           "segment, c10/cuda/CUDACachingAllocator.cpp); the CUDA context and libraries are outside it")
        return out


_FRACTION = re.compile(r"per_process_memory_fraction\s*[:=]\s*([0-9.eE+-]+)")


def fraction_in(alloc_conf: str) -> "float | None":
    """The ``per_process_memory_fraction`` a config's text sets (a ``PYTORCH_CUDA_ALLOC_CONF`` string or an
    :class:`AllocatorConfig`'s repr), None when it sets none."""
    match = _FRACTION.search(alloc_conf or "")
    try:
        return float(match.group(1)) if match else None
    except ValueError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return None


def resolve_gpu(gpu: Any) -> "GpuSpec | None":
    """``gpu=`` as given: None, a name (:func:`memprof.anatomy.gpus.gpu`, unknown names list the known ones)
    or a :class:`GpuSpec`."""
    if gpu is None or isinstance(gpu, GpuSpec):
        return gpu
    if not isinstance(gpu, str):
        raise InvalidArgumentError(f"gpu must be a GPU name ('h100-80gb') or a GpuSpec, got {type(gpu).__name__}")
    return gpu_by_name(gpu)


def resolve_conf(alloc_conf: Any, environ: "Mapping[str, str] | None" = None) -> tuple[AllocatorConfig, str]:
    """The allocator config and its text: ``alloc_conf`` (a ``PYTORCH_CUDA_ALLOC_CONF`` string or an
    :class:`AllocatorConfig`), or when None the environment's, as torch reads it at start-up."""
    environ = os.environ if environ is None else environ
    if alloc_conf is None:
        text = next((environ[n] for n in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if n in environ), "")
        return AllocatorConfig.from_env(environ), text
    if isinstance(alloc_conf, AllocatorConfig):
        return alloc_conf, repr(alloc_conf)
    if isinstance(alloc_conf, str):
        return AllocatorConfig.parse(alloc_conf), alloc_conf
    raise InvalidArgumentError(f"alloc_conf must be a PYTORCH_CUDA_ALLOC_CONF string (e.g. "
                               f"'expandable_segments:True') or an AllocatorConfig, got {type(alloc_conf).__name__}")


def outside_terms(gpu: "GpuSpec | None", *, backward: bool, world_size: int = 1, convolutions: bool = False,
                  environ: "Mapping[str, str] | None" = None) -> list[OutsideTerm]:
    """The terms beside the tensors: the CUDA context, the cuBLAS workspaces (one per thread that multiplies:
    the Python thread, and autograd's device thread when there is a backward), cuDNN's where convolutions
    ran, one NCCL communicator when ``world_size`` > 1."""
    environ = os.environ if environ is None else environ
    cc = gpu.compute_capability if gpu is not None else STREAM_UNKNOWN_GPU_CC
    context = gpu.context() if gpu is not None else cuda_context(module_loading=environ.get("CUDA_MODULE_LOADING"))
    terms = [context, cublas_workspaces(cc, handles=2 if backward else 1, env=environ)]
    if gpu is None:
        terms[1] = dataclasses.replace(terms[1], assumption=terms[1].assumption + "; no GPU given: sized for "
                                       "compute capability 9.0, the larger default")
    if convolutions:
        terms.append(cudnn_workspace(environ))
    if world_size > 1:
        terms.append(nccl_communicator(world_size, env=environ))
    return terms


@dataclass(frozen=True)
class Replay:
    """One run's allocation stream and the set-up its replay took: the allocator's config, the cuBLAS workspace
    blocks allocated after event ``first_seq``, the device's ``capacity`` (None without a GPU) and the bytes
    ``outside`` the allocator. :meth:`figures` replays another stream of the same run's shape (a batch not
    simulated) under the same set-up. The stream is kept flat, three ints per event (seq, key, bytes)."""

    events: "array[int]" = field(repr=False)
    first_seq: int
    config: AllocatorConfig
    workspaces: tuple[int, ...]
    capacity: "int | None"
    outside: int

    def stream(self) -> list[tuple[int, int, int]]:
        """The events as the ledger kept them: (seq, key, bytes), bytes -1 for a free."""
        e = self.events
        return list(zip(e[0::3], e[1::3], e[2::3]))

    def figures(self, stream: "Sequence[tuple[int, int, int]] | None" = None) -> tuple[int, "str | None", bool]:
        """The device-level peak of ``stream`` (this run's own by default), the predicted out-of-memory error's
        message or None when it fits, and whether memory was pressed: the replay without a cap went beyond the
        device, so that torch had to free its cache and retry (or failed), see :func:`device_memory`."""
        replayed = _replayed(self.stream() if stream is None else stream, (), self.config, self.workspaces,
                             self.first_seq, self.capacity, self.outside)
        return replayed.peak_reserved + self.outside, replayed.oom, replayed.pressed


#: Every Replay some record may still name (DeviceMemory.replay_id); weak, so a replay goes with its records.
_REPLAYS: "WeakValues[Replay]" = WeakValues()


def replay_of(memory: Any) -> "Replay | None":
    """The :class:`Replay` a simulation's :class:`DeviceMemory` came from (the record as ``memprof.estimate``
    returns it, or any copy of it), None for a measured run's figures. Kept beside the record rather than in it:
    a stream is no figure of the run, and the record stays plain data (``dataclasses.asdict``, JSON)."""
    return getattr(memory, "_replay", None)


class _Replayed(NamedTuple):
    """What :func:`_replayed` gives: (allocated, reserved) at each moment asked for, the allocator at the end, its
    peaks and retries, the out-of-memory message (None when it fits), and whether memory was pressed."""

    at: dict[int, tuple[int, int]]
    allocator: CachingAllocator
    peak_reserved: int
    peak_allocated: int
    retries: int
    oom: "str | None"
    pressed: bool


def _uncapped(config: AllocatorConfig) -> AllocatorConfig:
    """``config`` on a device with no limit: no memory fraction (torch's ``allowed_memory_maximum`` is unset at 1)."""
    if config.per_process_memory_fraction >= 1:
        return config
    return dataclasses.replace(config, per_process_memory_fraction=1.0)


def _replayed(stream: Sequence[tuple[int, int, int]], seqs: Iterable[int], config: AllocatorConfig,
              workspaces: Sequence[int], first: int, capacity: "int | None", outside: int,
              check: bool = False) -> _Replayed:
    """The replay of ``stream`` as a device would run it, at each of ``seqs``. First without any limit; where
    that replay does not fit ``capacity`` with ``outside``, or a memory fraction caps the allocator (torch's
    ``allowed_memory_maximum``, a fraction of ``capacity``), the verdict is that of a replay capped at what the
    device leaves the allocator, in which torch frees its cache and retries before it fails. Memory is *pressed*
    where the capped replay had to (or failed), or its peak is not the free one's (the fraction's garbage
    collector freed blocks). Without ``capacity`` (no GPU) no fraction applies: there is no device to take it of."""
    seqs = list(seqs)
    at, allocator, _ = replay_stream(stream, seqs, _uncapped(config), workspaces=workspaces, workspace_seq=first,
                                     check=check)
    oom = None
    peak_reserved, peak_allocated, retries = allocator.peak_reserved, allocator.peak_allocated, 0
    over = capacity is not None and peak_reserved + outside > capacity
    capped_by_fraction = capacity is not None and config.per_process_memory_fraction < 1
    pressed = over
    if over or capped_by_fraction:
        assert capacity is not None
        room = max(1, capacity - outside)
        at_capped, capped, oom = replay_stream(stream, seqs, config, workspaces=workspaces, workspace_seq=first,
                                               capacity=room, device_total=capacity, check=check)
        pressed = (over or oom is not None or capped.num_alloc_retries > 0
                   or capped.peak_reserved != allocator.peak_reserved)
        if oom is None:
            # The run that fits is the one that freed its cache and retried: every moment's figures are that
            # replay's, so that no record holds more than the device peak.
            peak_reserved, peak_allocated = capped.peak_reserved, capped.peak_allocated
            retries = capped.num_alloc_retries
            at, allocator = at_capped, capped
        else:
            oom = oom.split(". Fix:")[0]
    return _Replayed(at, allocator, peak_reserved, peak_allocated, retries, oom, pressed)


#: Set (to anything but 0) to check every device replay against its ledger and audit the allocator model after
#: every event: slow, for tests and debugging (:func:`memprof.simulate.alloc_stream.check_stream`,
#: :class:`memprof.anatomy.alloc_audit.AuditedAllocator`).
CHECK_ENV = "MEMPROF_CHECK_REPLAY"


def device_memory(trace: Trace, stream: Sequence[tuple[int, int, int]],
                  moments: Sequence[tuple[int, int, int, int]], peak_seq: int, *, gpu: "GpuSpec | None" = None,
                  alloc_conf: Any = None, world_size: int = 1, convolutions: bool = False,
                  environ: "Mapping[str, str] | None" = None) -> tuple[Trace, DeviceMemory]:
    """``trace`` with ``allocator_overhead`` and ``outside_torch`` filled in at every recorded moment, and the
    run's :class:`DeviceMemory`. ``stream`` and ``moments`` are the ledger's (:meth:`Ledger.record_stream`),
    ``peak_seq`` where its global peak was. The replay starts where the run does, at its first phase
    (:func:`~memprof.simulate.alloc_stream.from_start`). With ``MEMPROF_CHECK_REPLAY=1`` in the environment the
    stream is checked against the trace's figures and the allocator model audited after every event."""
    environ = os.environ if environ is None else environ
    config, text = resolve_conf(alloc_conf, environ)
    backward = any(p.phase is Phase.BACKWARD for s in trace.steps for p in s.phases)
    terms = outside_terms(gpu, backward=backward, world_size=world_size, convolutions=convolutions,
                          environ=environ)
    workspaces = _workspace_blocks(gpu, 2 if backward else 1, environ)
    outside = sum(t.bytes for t in terms if not t.through_allocator)
    first = moments[0][1] if moments else 0
    stream = from_start(stream, first)
    placed = _place(trace, moments)
    peak_seq = _peak_seq(trace, placed, peak_seq)
    end_seq = stream[-1][0] if stream else 0
    seqs = [max(s, first) for m in placed.values() for s in m] + [first, max(peak_seq, first), end_seq]
    checking = environ.get(CHECK_ENV, "0") not in ("", "0")
    if checking:
        _check_ledger(trace, stream, placed, first, peak_seq, end_seq)
    capacity = gpu.allocatable_bytes if gpu is not None else None
    at, allocator, peak_reserved, peak_allocated, retries, oom, _ = _replayed(stream, seqs, config, workspaces,
                                                                              first, capacity, outside, checking)
    # What the replay took, for replaying a stream predicted for another batch (replay_of), named by the record
    # so that its copies find it too.
    replay = Replay(array("q", [x for event in stream for x in event]), first, config, tuple(workspaces), capacity,
                    outside)
    replay_id = uuid.uuid4().hex
    _REPLAYS[replay_id] = replay
    summary = DeviceMemory(gpu=gpu, alloc_conf=text, terms=tuple(terms), peak_allocated=peak_allocated,
                           peak_reserved=peak_reserved, outside_bytes=outside, segments=len(allocator.segments()),
                           capacity=capacity, oom=oom, num_alloc_retries=retries, replay_id=replay_id)

    def filled(b: Breakdown, seq: int) -> Breakdown:
        tensors = b.counts[:_N]
        if any(v is None for v in tensors):
            return b
        reserved = at.get(max(seq, first), (0, 0))[1]
        overhead = max(0, reserved - sum(tensors))
        return Breakdown(tensors + (overhead, outside), sum(tensors) + overhead + outside)

    steps = []
    for step in trace.steps:
        phases = []
        for i, rec in enumerate(step.phases):
            where = placed.get((step.index, i))
            if where is not None:
                rec = dataclasses.replace(rec, start=filled(rec.start, where[0]), peak=filled(rec.peak, where[1]),
                                          end=filled(rec.end, where[2]))
            phases.append(rec)
        steps.append(dataclasses.replace(step, phases=tuple(phases)))
    device = DeviceInfo(type="cuda", name=gpu.name if gpu is not None else "cuda (no GPU given)",
                        total_memory=capacity, rounding=trace.device.rounding,
                        max_memory_allocated=summary.peak_allocated, memory_reserved=summary.peak_reserved)
    out = dataclasses.replace(trace, steps=tuple(steps), start=filled(trace.start, first),
                              peak=filled(trace.peak, peak_seq), end=filled(trace.end, end_seq), device=device)
    return out, summary


def _peak_seq(trace: Trace, placed: Mapping[tuple[int, int], tuple[int, int, int]], ledger_peak: int) -> int:
    """Where the trace's peak is: the peak of the phase it names (a simulated rank's record takes its peak from its
    phases after the run, :meth:`memprof.simulate.ranks.LayoutPlan.finish`, where the ledger's own global peak
    may be elsewhere), else the ledger's."""
    for step in trace.steps:
        if step.index != trace.peak_step:
            continue
        for i, rec in enumerate(step.phases):
            where = placed.get((step.index, i))
            if where is not None and rec.phase == trace.peak_phase and rec.peak == trace.peak:
                return where[1]
    return ledger_peak


def _check_ledger(trace: Trace, stream: Sequence[tuple[int, int, int]],
                  placed: Mapping[tuple[int, int], tuple[int, int, int]], first: int, peak_seq: int,
                  end_seq: int) -> None:
    """The stream the replay runs is the ledger's: at every recorded moment from the run's start its live bytes
    are the trace's tensors there, and at no event above the trace's peak (``AssertionError`` otherwise)."""
    expected: dict[int, int] = {}

    def note(b: Breakdown, seq: int) -> None:
        tensors = b.counts[:_N]
        if seq >= first and all(v is not None for v in tensors):
            expected[seq] = sum(tensors)  # type: ignore[arg-type]

    for step in trace.steps:
        for i, rec in enumerate(step.phases):
            where = placed.get((step.index, i))
            if where is not None:
                for b, seq in zip((rec.start, rec.peak, rec.end), where):
                    note(b, seq)
    note(trace.start, first)
    note(trace.peak, peak_seq)
    note(trace.end, end_seq)
    ceiling = sum(v for v in trace.peak.counts[:_N] if v is not None)
    # A simulated rank's optimizer steps, which its stream and its figures each take the rank's share of
    # (memprof.simulate.alloc_stream.rank_step, LayoutPlan.finish).
    ranked = trace.distributed is not None and trace.distributed.layout in ("fsdp", "zero1", "zero2", "zero3")
    scaled = [(where[0], where[2]) for step in trace.steps for i, rec in enumerate(step.phases)
              if ranked and rec.phase is Phase.OPTIMIZER and (where := placed.get((step.index, i))) is not None]
    check_stream(stream, max(1, trace.device.rounding or 1), expected, ceiling, scaled)


def _workspace_blocks(gpu: "GpuSpec | None", handles: int, environ: "Mapping[str, str] | None") -> list[int]:
    """The allocator blocks of the cuBLAS workspaces: per handle, cuBLAS's and (when not shared) cuBLASLt's
    (``getCurrentCUDABlasHandle`` and ``getCUDABlasLtWorkspace`` take them from the caching allocator)."""
    environ = os.environ if environ is None else environ
    cc = gpu.compute_capability if gpu is not None else STREAM_UNKNOWN_GPU_CC
    each = [cublas_workspace_bytes(cc, environ), cublaslt_workspace_bytes(cc, environ)]
    return [b for _ in range(handles) for b in each if b > 0]


def _place(trace: Trace, moments: Sequence[tuple[int, int, int, int]]) -> dict[tuple[int, int], tuple[int, int, int]]:
    """Each kept phase record (step index, position in the step) -> its (start, peak, end) seqs. The ledger
    noted one moment per phase closed, with the step it closed in; a trailing step of "other" phases that
    joined the previous one (``PhaseTracker.finish``) continues it."""
    by_step: dict[int, list[tuple[int, int, int]]] = {}
    for step, start, peak, end in moments:
        by_step.setdefault(step, []).append((start, peak, end))
    out: dict[tuple[int, int], tuple[int, int, int]] = {}
    for step in trace.steps:
        mine = list(by_step.get(step.index, ()))
        if len(mine) < len(step.phases):
            mine += by_step.get(step.index + 1, [])[:len(step.phases) - len(mine)]
        for i, seqs in enumerate(mine[:len(step.phases)]):
            out[(step.index, i)] = seqs
    return out


def uses_convolutions(model: Any) -> bool:
    """Does ``model`` hold a convolution (cuDNN runs it on CUDA)?"""
    return any(type(m).__name__.startswith(("Conv", "LazyConv")) for m in model.modules())



@dataclass(frozen=True)
class AllocationStream:
    """A run's allocation stream as its ledger kept it (``profile(record_allocations=True)``): the events, one
    moment per phase, and where the global peak was. Not saved with the trace."""

    stream: tuple[tuple[int, int, int], ...]
    moments: tuple[tuple[int, int, int, int], ...]
    peak_seq: int

    @classmethod
    def of(cls, ledger: Any) -> "AllocationStream | None":
        if ledger.stream is None:
            return None
        return cls(tuple(ledger.stream), tuple(ledger.moments or ()), ledger.peak_seq)


def what_a_gpu_would_reserve(trace: Trace, allocations: "AllocationStream | None", *, gpu: Any = None,
                             alloc_conf: Any = None) -> DeviceMemory:
    """The device-level figures of a measured run's allocation stream on ``gpu`` (on a CUDA run, by default its
    own GPU when memprof knows its name), with the measured reserved and outside-torch bytes beside them."""
    from ..errors import NotMeasuredError

    if allocations is None:
        raise NotMeasuredError("this report has no allocation stream: profile with memprof.profile(..., "
                               "record_allocations=True) (exact mode), and ask the report of that run (a saved "
                               "trace does not keep the stream)")
    spec = resolve_gpu(gpu)
    device = trace.device
    if spec is None and device.type == "cuda":
        try:
            spec = gpu_by_name(device.name)
        except Exception as failure:  # a GPU memprof does not know by name: figures without a verdict
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            spec = None
    ranks = trace.distributed
    out, summary = device_memory(trace, allocations.stream, allocations.moments, allocations.peak_seq, gpu=spec,
                                 alloc_conf=alloc_conf, world_size=ranks.world_size if ranks is not None else 1)
    measured_outside = None
    if device.type == "cuda" and device.nvml_used is not None and device.memory_reserved is not None:
        measured_outside = max(0, device.nvml_used - device.memory_reserved)
    return dataclasses.replace(summary, peak=out.peak,
                               measured_reserved=device.memory_reserved if device.type == "cuda" else None,
                               measured_outside=measured_outside)


def check_target(gpu: Any, device: Any, alloc_conf: Any) -> tuple["GpuSpec | None", Any]:
    """``gpu=``, ``device=`` and ``alloc_conf=`` of an estimate, checked before anything runs: the GPU's spec
    and the device to simulate (a GPU means ``"cuda"``)."""
    spec = resolve_gpu(gpu)
    kind = None if device is None else str(device).split(":")[0]
    if spec is not None:
        if kind is None:
            device, kind = "cuda", "cuda"
        elif kind != "cuda":
            raise InvalidArgumentError(f"gpu={spec.name!r} is a CUDA device, but device={str(device)!r}; leave "
                                       "device unset (or 'cuda') to estimate for the GPU")
    if alloc_conf is not None:
        if kind != "cuda" and spec is None:
            raise InvalidArgumentError("alloc_conf= configures the CUDA caching allocator; give device='cuda' or gpu= "
                                       "with it (a CPU target has no caching allocator)")
        resolve_conf(alloc_conf)  # a string torch would refuse fails here, before the simulation
    return spec, device


def on_device(est: Any, recorded: "RecordedStream", *, gpu: "GpuSpec | None", alloc_conf: Any, world_size: int = 1,
              model: Any = None) -> Any:
    """The estimate ``est`` (a frozen dataclass with ``trace``, ``notes`` and ``device_memory``) with its device
    rows and :class:`DeviceMemory`, from the stream its simulated profile ``recorded``."""
    trace, summary = device_memory(est.trace, recorded.events, recorded.moments, recorded.peak_seq, gpu=gpu,
                                   alloc_conf=alloc_conf, world_size=world_size,
                                   convolutions=model is not None and uses_convolutions(model))
    notes = list(est.notes) + summary.notes()
    if world_size > 1:
        notes.append("device memory of a rank: the replay follows the rank's own allocations as simulated, from "
                     "the run's start (the whole model the profile registered before the layout sharded it is no "
                     "rank's); a sharded optimizer step is replayed as the rank makes it, its state at the rank's "
                     "part from the start and its other storages at the rank's share, rounded up; the collectives' "
                     "staging inside NCCL is its communicator's term")
    return dataclasses.replace(est, trace=trace, device_memory=summary, notes=tuple(notes))
