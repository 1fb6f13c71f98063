"""The collector as a simulation drives it: the one seam between :mod:`memprof.simulate` and the profiler.

A simulation (:mod:`memprof.simulate`) runs a training step on a model's shape-only twin under the same
profiler a real run uses, in exact mode, and plays on it what a real run has and a single process does not:
a rank's shards and collective buffers (:mod:`memprof.simulate.ranks`), tokens joining a cache outside the
model, the allocation stream the device replay needs. Everything it does to the collectors goes through
:class:`SimulatedProfile`'s methods, each named for what it does to the run's accounting; nothing in
:mod:`memprof.simulate` reaches into the profiler's ledger, its collectors or its private arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import marks
from ..vocabulary import Category, Phase
from .dispatch import DispatchMode
from .ledger import CATEGORY_OF_INDEX, Entry
from .moves import move
from .profiler import Profiler
from .routing import innermost_module
from .streams import ONE_STREAM, StreamSwitches, StreamUse

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .wiring import Collectors

__all__ = ["RecordedStream", "SimulatedProfile", "SimulatedDispatchMode"]

_INDEX = {c: i for i, c in enumerate(CATEGORY_OF_INDEX)}


@dataclass(frozen=True)
class RecordedStream:
    """What the allocator replay takes from a simulated run: every storage made, resized and freed, in order,
    as ``(seq, key, bytes)`` (bytes ``-1`` for a free); each phase closed as ``(step, start seq, peak seq,
    end seq)``; where the ledger's global peak was; and how its storages use CUDA streams
    (:class:`~memprof.collect.streams.StreamUse`)."""

    events: tuple[tuple[int, int, int], ...]
    moments: tuple[tuple[int, int, int, int], ...]
    peak_seq: int
    streams: StreamUse = ONE_STREAM
    #: The category each storage was made in, one per storage made, in order (empty: not known).
    cats: tuple[int, ...] = ()
    #: Each move of a live storage to another category, as (seq, key, the category it moved to).
    moves: tuple[tuple[int, int, int], ...] = ()
    #: The seqs of the moves that also moved the storage in the peak of the phase it was made in, where it was live
    #: then (a storage that only later shows what it was: a gradient, an optimizer state, a saved activation).
    retro: tuple[int, ...] = ()


# Off: torch function handling, for subclasses and modes alike (torch/csrc/utils/disable_torch_function.cpp).
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
#: A tensor's device asked from C++ as an op (a fake tensor's: a real one answers without an op).
PRIM_DEVICE = torch.ops.prim.device.default


def fake_device(args: "tuple[object, ...]") -> "torch.device | None":
    """The answer to :data:`PRIM_DEVICE` called with ``args`` where it asks a fake tensor (its ``fake_device``),
    which a simulation's modes give without handing the call on; None otherwise. (The callers test ``func is
    PRIM_DEVICE`` themselves: a call for every other op would cost each op a Python frame.)"""
    device: "torch.device | None" = getattr(args[0], "fake_device", None) if args else None
    return device


class SimulatedDispatchMode(DispatchMode):
    """The collector's mode in a simulation: its handler, and every op beneath it, runs with torch function handling
    off. A simulation's function mode (``memprof.simulate.modes.Rules``) is about the model's own calls; an op's
    bookkeeping (its storages looked up, its outputs' metadata read) and its redispatch through the simulation's
    lower modes and kernels would each reach that mode, about six calls per op, only to be handed on. A real
    profile's mode stays as it is: it has no such mode above it, and exact mode's calls per op are pinned.

    A fake tensor's ``device`` asked from C++ (by autograd for every gradient, by DTensor, indexing it, ``x.to(...)``
    in a step's own code) is the op ``prim.device``, which a real tensor answers without an op: it is answered
    first, as no op of the run. Counted, it would make an "other" phase of a user's step's code that touches no
    memory, where the real run records none; handed on, it would cost the modes beneath a Python call per query
    (77,000 queries in a 405B pipeline stage's cuts). (A meta tensor answers its device in C++.)"""

    def __torch_dispatch__(self, func: "OpOverload", types: "tuple[type, ...]", args: "tuple[object, ...]" = (),
                           kwargs: "dict[str, object] | None" = None) -> object:
        if func is PRIM_DEVICE:
            device = fake_device(args)
            if device is not None:
                return device
        with _NO_TORCH_FUNCTION():
            return DispatchMode.__torch_dispatch__(self, func, types, args, kwargs)


class SimulatedProfile(Profiler):
    """An exact-mode profile of a shape-only twin (``model``, ``optimizer``): ``fake_mode`` is the simulation's
    fake-tensor mode (its tensors are the run's; None on meta tensors), ``rounding`` the target allocator's
    granularity (512 on CUDA, 1 on CPU), ``keep_stream`` keeps the allocation stream for a device replay.

    Enter it around the simulated steps as any profile; :attr:`trace` is the record afterwards. The methods
    below are what a simulated layout plays on the run while it is recorded (:attr:`recording`)."""

    _dispatch_mode = SimulatedDispatchMode

    def __init__(self, model: torch.nn.Module, optimizer: "torch.optim.Optimizer | None", *,
                 fake_mode: "FakeTensorMode | None", rounding: int, keep_stream: bool) -> None:
        super().__init__(model, optimizer, mode="exact", timeline=False, _allow_meta=True, _fake_mode=fake_mode,
                         _rounding=rounding)
        self._switches: "StreamSwitches | None" = None
        if keep_stream:
            marks.record_stream(self.ledger)
            self._switches = StreamSwitches(self.ledger)

    def __enter__(self) -> "SimulatedProfile":
        super().__enter__()
        if self._switches is not None and self._stack is not None:
            # after the profile's own hooks, on its undo stack: gone when the profile ends, whatever ends it
            self._stack.callback(self._switches.uninstall)
            self._switches.install()
        return self

    def recorded_stream(self) -> RecordedStream:
        """The allocation stream kept (``keep_stream=True``), for the device replay."""
        led = self.ledger
        switches = tuple(self._switches.switches) if self._switches is not None else ()
        flat = self.collectors.flat if self.collectors is not None else None
        held = tuple(flat.gathered.items()) if flat is not None else ()
        return RecordedStream(tuple(led.stream or ()), tuple(led.moments or ()), led.peak_seq,
                              StreamUse(switches, held), cats=tuple(led.stream_cats),
                              moves=tuple(led.stream_moves), retro=tuple(led.stream_retro))

    # -- what a simulated layout plays on the run ------------------------------------------------------------

    @property
    def recording(self) -> bool:
        """The profile has begun and records now."""
        c = self.collectors
        return c is not None and c.run.active

    def collectives_end_in_backward(self) -> None:
        """The last collectives of a backward (a reduce-scatter, a resharding) belong to it, not to what follows."""
        self._collectors().run.backward_waits = True

    def restart(self) -> None:
        """The run starts from here: what the profile registered before (the whole model, before a layout
        sharded it) is not this run's, and the global peak starts over."""
        self._collectors().restart()

    def resize(self, t: torch.Tensor, nbytes: int) -> None:
        """``t``'s storage holds ``nbytes`` from now on (a rank's shard of a whole tensor); unknown: nothing."""
        entry = self._collectors().storages.entry_of(t)
        if entry is not None:
            self.ledger.resize(entry, nbytes)

    def grow(self, t: torch.Tensor, nbytes: int) -> None:
        """``t``'s storage holds ``nbytes`` more from now on (a reduce-scatter's output made beside its input)."""
        entry = self._collectors().storages.entry_of(t)
        if entry is not None:
            self.ledger.resize(entry, entry.nbytes + nbytes)

    def claim(self, t: torch.Tensor, category: Category) -> None:
        """``t``'s storage is ``category`` from now on, and was since it was made (at the peaks of the phase it
        was made in too)."""
        self._moved(self._collectors().storages.add_tensor(t, _INDEX[category]), category)

    def add_buffer(self, t: torch.Tensor, category: Category) -> None:
        """``t`` (made outside the model's ops: a collective's buffer) is ``category`` since it was made."""
        self._moved(self.ledger.add(t.untyped_storage(), _INDEX[category]), category)

    def add_tokens(self, n: int) -> None:
        """``n`` tokens joined the cache outside the model's forward (a decoding loop that grows it directly)."""
        self._collectors().kv.add_tokens(n)

    def backwards(self) -> int:
        """How many backward passes the step that runs now has begun (0 outside the block)."""
        c = self.collectors
        return c.phases.occurrence.get(Phase.BACKWARD, 0) if c is not None else 0

    def innermost_module(self) -> "str | None":
        """The path of the innermost module whose forward runs now; None outside the model or the block."""
        c = self.collectors
        return innermost_module(c.run, c.table) if c is not None else None

    def open_stream(self) -> "tuple[list[tuple[int, int, int]], int, int] | None":
        """The allocation stream being kept, to be rewritten in place after an optimizer step a rank makes at
        its share (:func:`memprof.simulate.alloc_stream.rank_step`), with the seq where the phase began and the
        allocator's rounding; None when no stream is kept."""
        led = self.ledger
        if led.stream is None:
            return None
        led.settle()
        return led.stream, led.phase_start_seq, led.rounding

    def _moved(self, entry: "Entry | None", category: Category) -> None:
        if entry is not None and entry.cat != _INDEX[category]:
            move(self.ledger, entry, _INDEX[category], retro=True)

    def _collectors(self) -> "Collectors":
        c = self.collectors
        if c is None:
            raise RuntimeError("the simulated profile has not begun: enter it before playing a layout on it")
        return c
