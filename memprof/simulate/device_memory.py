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
import uuid
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ..anatomy.alloc_config import AllocatorConfig
from ..anatomy.allocator import CachingAllocator
from ..anatomy.gpus import GpuSpec, gpu as gpu_by_name
from ..collect.streams import ONE_STREAM, StreamUse
from ..anatomy.outside import (OutsideTerm, cublas_workspace_bytes, cublas_workspaces, cublaslt_workspace_bytes,
                                cuda_context, cudnn_workspace, nccl_communicator)
from ..errors import InvalidArgumentError, is_interrupt
from ..record.device_memory import DeviceMemory, keep_replay
from ..record.trace import Breakdown, DeviceInfo, Trace
from ..vocabulary import TENSOR_CATEGORIES, Phase
from .alloc_stream import check_stream, from_start, replay_stream

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..collect.ledger import Ledger
    from ..collect.simulated import RecordedStream
    from ..record.estimate import Estimate
    from ..record.parts import PhaseRecord

__all__ = ["DeviceMemory", "Replay", "replay_of", "device_memory", "resolve_gpu", "resolve_conf", "outside_terms",
           "replay_stream", "STREAM_UNKNOWN_GPU_CC"]

#: Without a GPU the workspaces are sized for the larger of torch's defaults: Hopper and Blackwell's 32 MiB
#: (compute capability 9.0 and up, ``CublasHandlePool.cpp``), so that no GPU is under-estimated.
STREAM_UNKNOWN_GPU_CC = (9, 0)
_N = len(TENSOR_CATEGORIES)


def resolve_gpu(gpu: object) -> "GpuSpec | None":
    """``gpu=`` as given: None, a name (:func:`memprof.anatomy.gpus.gpu`, unknown names list the known ones)
    or a :class:`GpuSpec`."""
    if gpu is None or isinstance(gpu, GpuSpec):
        return gpu
    if not isinstance(gpu, str):
        raise InvalidArgumentError(f"gpu must be a GPU name ('h100-80gb') or a GpuSpec, got {type(gpu).__name__}")
    return gpu_by_name(gpu)


def resolve_conf(alloc_conf: object, environ: "Mapping[str, str] | None" = None) -> tuple[AllocatorConfig, str]:
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
    #: How the run's storages use streams (:func:`~memprof.simulate.alloc_stream.replay_stream`); a stream predicted
    #: for another batch keeps the seqs and keys, so the same use places its storages.
    streams: StreamUse = ONE_STREAM

    def stream(self) -> list[tuple[int, int, int]]:
        """The events as the ledger kept them: (seq, key, bytes), bytes -1 for a free."""
        e = self.events
        return list(zip(e[0::3], e[1::3], e[2::3]))

    def figures(self, stream: "Sequence[tuple[int, int, int]] | None" = None) -> tuple[int, "str | None", bool]:
        """The device-level peak of ``stream`` (this run's own by default), the predicted out-of-memory error's
        message or None when it fits, and whether memory was pressed: the replay without a cap went beyond the
        device, so that torch had to free its cache and retry (or failed), see :func:`device_memory`."""
        replayed = _replayed(self.stream() if stream is None else stream, (), self.config, self.workspaces,
                             self.first_seq, self.capacity, self.outside, streams=self.streams)
        return replayed.peak_reserved + self.outside, replayed.oom, replayed.pressed


def replay_of(memory: "DeviceMemory | None") -> "Replay | None":
    """The :class:`Replay` a simulation's :class:`DeviceMemory` came from (the record as ``memprof.estimate``
    returns it, or any copy of it), None for a measured run's figures. Kept beside the record rather than in it:
    a stream is no figure of the run, and the record stays plain data (``dataclasses.asdict``, JSON)."""
    replay: "Replay | None" = getattr(memory, "_replay", None)  # a Replay kept by keep_replay, or none
    return replay


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
              check: bool = False, streams: StreamUse = ONE_STREAM) -> _Replayed:
    """The replay of ``stream`` as a device would run it, at each of ``seqs``. First without any limit; where
    that replay does not fit ``capacity`` with ``outside``, or a memory fraction caps the allocator (torch's
    ``allowed_memory_maximum``, a fraction of ``capacity``), the verdict is that of a replay capped at what the
    device leaves the allocator, in which torch frees its cache and retries before it fails. Memory is *pressed*
    where the capped replay had to (or failed), or its peak is not the free one's (the fraction's garbage
    collector freed blocks). Without ``capacity`` (no GPU) no fraction applies: there is no device to take it of."""
    seqs = list(seqs)
    at, allocator, _ = replay_stream(stream, seqs, _uncapped(config), workspaces=workspaces, workspace_seq=first,
                                     check=check, streams=streams)
    oom = None
    peak_reserved, peak_allocated, retries = allocator.peak_reserved, allocator.peak_allocated, 0
    over = capacity is not None and peak_reserved + outside > capacity
    capped_by_fraction = capacity is not None and config.per_process_memory_fraction < 1
    pressed = over
    if over or capped_by_fraction:
        assert capacity is not None
        room = max(1, capacity - outside)
        at_capped, capped, oom = replay_stream(stream, seqs, config, workspaces=workspaces, workspace_seq=first,
                                               capacity=room, device_total=capacity, check=check,
                                               streams=streams)
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
                  alloc_conf: "str | AllocatorConfig | None" = None, world_size: int = 1, convolutions: bool = False,
                  environ: "Mapping[str, str] | None" = None,
                  streams: StreamUse = ONE_STREAM) -> tuple[Trace, DeviceMemory]:
    """``trace`` with ``allocator_overhead`` and ``outside_torch`` filled in at every recorded moment, and the
    run's :class:`DeviceMemory`. ``stream`` and ``moments`` are the ledger's (:meth:`Ledger.record_stream`),
    ``peak_seq`` where its global peak was. The replay starts where the run does, at its first phase
    (:func:`~memprof.simulate.alloc_stream.from_start`). With ``MEMPROF_CHECK_REPLAY=1`` in the environment the
    stream is checked against the trace's figures and the allocator model audited after every event.
    ``streams`` places each storage on the stream the run made it on and holds the blocks a library uses on another
    stream (:func:`~memprof.simulate.alloc_stream.replay_stream`)."""
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
                                                                              first, capacity, outside, checking,
                                                                              streams)
    # What the replay took, for replaying a stream predicted for another batch (replay_of), named by the record
    # so that its copies find it too.
    replay = Replay(array("q", [x for event in stream for x in event]), first, config, tuple(workspaces), capacity,
                    outside, streams)
    replay_id = uuid.uuid4().hex
    keep_replay(replay_id, replay)
    summary = DeviceMemory(gpu=gpu, alloc_conf=text, terms=tuple(terms), peak_allocated=peak_allocated,
                           peak_reserved=peak_reserved, outside_bytes=outside, segments=len(allocator.segments()),
                           capacity=capacity, oom=oom, num_alloc_retries=retries, replay_id=replay_id)

    def filled(b: Breakdown, seq: int) -> Breakdown:
        tensors = b.counts[:_N]
        known = [v for v in tensors if v is not None]
        if len(known) < len(tensors):
            return b
        reserved = at.get(max(seq, first), (0, 0))[1]
        overhead = max(0, reserved - sum(known))
        return Breakdown(tensors + (overhead, outside), sum(known) + overhead + outside)

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

    def tensors(b: Breakdown) -> "int | None":
        counts = b.counts[:_N]
        return None if None in counts else sum(v or 0 for v in counts)

    def note(b: Breakdown, seq: int) -> None:
        if seq >= first and (held := tensors(b)) is not None:
            expected[seq] = held

    phases: list[tuple[int, int, int]] = []  # each phase's span of seqs and its peak's tensors
    for step in trace.steps:
        for i, rec in enumerate(step.phases):
            where = placed.get((step.index, i))
            if where is not None:
                for b, seq in zip((rec.start, rec.peak, rec.end), where):
                    note(b, seq)
                if where[0] >= first and (top := tensors(rec.peak)) is not None:
                    phases.append((where[0], where[2], top))
    note(trace.start, first)
    note(trace.peak, peak_seq)
    note(trace.end, end_seq)
    ceiling = sum(v for v in trace.peak.counts[:_N] if v is not None)
    scaled = [(where[0], where[2]) for step in trace.steps for i, rec in enumerate(step.phases)
              if scaled_step(trace, rec) and (where := placed.get((step.index, i))) is not None]
    check_stream(stream, max(1, trace.device.rounding or 1), expected, ceiling, scaled, phases)


def scaled_step(trace: Trace, rec: "PhaseRecord") -> bool:
    """Is ``rec`` an optimizer step of a simulated ZeRO or FSDP rank, which its stream and its figures each take the
    rank's share of, differently (:func:`memprof.simulate.alloc_stream.rank_step`, ``LayoutPlan.finish``)?"""
    return (rec.phase is Phase.OPTIMIZER and trace.distributed is not None
            and trace.distributed.layout in ("fsdp", "zero1", "zero2", "zero3"))


def moments_of(trace: Trace, recorded: RecordedStream
               ) -> tuple[dict[tuple[int, int], tuple[int, int, int]], int, int, int]:
    """Where ``trace``'s moments are in ``recorded`` (a :class:`~memprof.collect.simulated.RecordedStream`): each
    phase record's (start, peak, end) seqs by (step index, position in the step), and the seqs of the run's start,
    its peak and its end, as :func:`device_memory` places them."""
    first = recorded.moments[0][1] if recorded.moments else 0
    placed = _place(trace, recorded.moments)
    events = recorded.events
    end = max(events[-1][0], first) if events else first
    return placed, first, _peak_seq(trace, placed, recorded.peak_seq), end


def stream_holds(trace: Trace, recorded: RecordedStream) -> "str | None":
    """Does ``recorded`` (a :class:`~memprof.collect.simulated.RecordedStream`) hold ``trace``'s tensors, to the
    byte, at every phase's start, peak and end from the run's start (:func:`_check_ledger`)? None if it does, else
    where it does not. A stream memprof made rather than recorded (:mod:`memprof.simulate.depth_stream`) is replayed
    only where it does."""
    placed, first, peak, end = moments_of(trace, recorded)
    try:
        _check_ledger(trace, from_start(recorded.events, first), placed, first, peak, end)
    except AssertionError as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return str(exc)
    return None


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
    joined the previous one (:func:`memprof.collect.phase_records.finish`) continues it."""
    by_step: dict[int, list[tuple[int, int, int]]] = {}
    for step, start, peak, end in moments:
        by_step.setdefault(step, []).append((start, peak, end))
    out: dict[tuple[int, int], tuple[int, int, int]] = {}
    for rec in trace.steps:
        mine = list(by_step.get(rec.index, ()))
        if len(mine) < len(rec.phases):
            mine += by_step.get(rec.index + 1, [])[:len(rec.phases) - len(mine)]
        for i, seqs in enumerate(mine[:len(rec.phases)]):
            out[(rec.index, i)] = seqs
    return out


def uses_convolutions(model: nn.Module) -> bool:
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
    def of(cls, ledger: Ledger) -> "AllocationStream | None":
        if ledger.stream is None:
            return None
        return cls(tuple(ledger.stream), tuple(ledger.moments or ()), ledger.peak_seq)


def what_a_gpu_would_reserve(trace: Trace, allocations: "AllocationStream | None", *,
                             gpu: "str | GpuSpec | None" = None,
                             alloc_conf: "str | AllocatorConfig | None" = None) -> DeviceMemory:
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


def check_target(gpu: "str | GpuSpec | None", device: "str | torch.device | None",
                 alloc_conf: "str | AllocatorConfig | None") -> tuple["GpuSpec | None", "str | torch.device | None"]:
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


def on_device(est: Estimate, recorded: "RecordedStream", *, gpu: "GpuSpec | None",
              alloc_conf: "str | AllocatorConfig | None", world_size: int = 1,
              model: "nn.Module | None" = None) -> Estimate:
    """The estimate ``est`` (a frozen dataclass with ``trace``, ``notes`` and ``device_memory``) with its device
    rows and :class:`DeviceMemory`, from the stream its simulated profile ``recorded``."""
    trace, summary = device_memory(est.trace, recorded.events, recorded.moments, recorded.peak_seq, gpu=gpu,
                                   alloc_conf=alloc_conf, world_size=world_size,
                                   convolutions=model is not None and uses_convolutions(model),
                                   streams=recorded.streams)
    notes = list(est.notes) + summary.notes()
    if world_size > 1:
        notes.append("device memory of a rank: the replay follows the rank's own allocations as simulated, from "
                     "the run's start (the whole model the profile registered before the layout sharded it is no "
                     "rank's); a sharded optimizer step is replayed as the rank makes it, its state at the rank's "
                     "part from the start and its other storages at the rank's share, rounded up; the collectives' "
                     "staging inside NCCL is its communicator's term")
    return dataclasses.replace(est, trace=trace, device_memory=summary, notes=tuple(notes))
