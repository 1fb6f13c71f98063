"""The device-level figures of a run on a (simulated) CUDA device: :class:`DeviceMemory`, plain data, no torch
needed to read it. :mod:`memprof.simulate.device_memory` makes it (the caching allocator's replay and the memory
outside torch); its text is a view registered from above (:mod:`.views`)."""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field

from ..errors import is_interrupt
from .trace import Breakdown
from .aliases import Above
from .views import show

__all__ = ["DeviceMemory", "fraction_in", "keep_replay"]


class _Kept:
    """Objects by name, held weakly, with no callback (a finaliser would run Python code where a signal
    handler's exception is dropped): a name whose object died reads as absent, and is forgotten at the next
    :meth:`put`."""

    def __init__(self) -> None:
        self._refs: "dict[str, weakref.ref[object]]" = {}

    def put(self, name: str, obj: object) -> None:
        self._refs = {key: ref for key, ref in self._refs.items() if ref() is not None}
        self._refs[name] = weakref.ref(obj)

    def get(self, name: str) -> object:
        ref = self._refs.get(name)
        return ref() if ref is not None else None


#: Every replay some record may still name (DeviceMemory.replay_id); weak, so a replay goes with its records.
_KEPT = _Kept()


def keep_replay(replay_id: str, replay: object) -> None:
    """Name ``replay`` (:class:`memprof.simulate.device_memory.Replay`) ``replay_id``: every :class:`DeviceMemory`
    made with that ``replay_id`` holds it, so that it lives as long as one of them does."""
    _KEPT.put(replay_id, replay)


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

    #: The GPU (a :class:`memprof.anatomy.gpus.GpuSpec`), None without one.
    gpu: Above
    alloc_conf: str
    #: Each a :class:`memprof.anatomy.outside.OutsideTerm` (name, bytes, through_allocator, assumption, source).
    terms: tuple[Above, ...]
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
    #: Names the replay a simulation's record came from (:class:`memprof.simulate.device_memory.Replay`), so
    #: that every copy of the record (``dataclasses.replace``) finds it (``replay_of``); a plain string, so that
    #: the record stays plain data. None for a measured run's figures.
    replay_id: "str | None" = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        replay = _KEPT.get(self.replay_id) if self.replay_id is not None else None
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

    def to_text(self) -> str:
        """The verdict, a measured run's comparison and every term with its source: what ``print()`` shows."""
        text: str = show(self, "to_text")
        return text

    def __str__(self) -> str:
        return self.to_text()


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
