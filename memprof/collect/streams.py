"""The CUDA stream each storage of a simulated run would be made on, for the allocator replay.

torch's caching allocator keeps its free blocks per stream: a block is made on the stream current when it was
asked for, goes back to that stream's pool when freed, and only a later request on the same stream may take it
(c10/cuda/CUDACachingAllocator.cpp: ``BlockComparatorSize`` orders a pool by stream first, ``get_free_block``
searches the request's stream only). Libraries that make buffers on side streams therefore hold more cache
than one pool would: FSDP2 makes each all-gather's output on its copy-in stream and each reduce-scatter's output
(the sharded gradients, views of it) on its reduce-scatter stream (torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py, ``foreach_all_gather`` and ``foreach_reduce``), so a step's gradients, freed by
``zero_grad``, stay cached where the next forward's activations cannot reuse them.

A simulation runs such a library on the CPU, where ``torch.cpu.stream(s)`` (what FSDP2's device handle gives
for a CPU device) makes no stream current. While a simulated profile keeps its allocation stream,
:class:`StreamSwitches` puts a context in its place that notes, at the ledger's event count, which stream the
code made current: every storage made after a switch (a larger seq) and before the next is that stream's.
Stream 0 is the device's current stream; side streams are numbered in the order they are first entered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager, Protocol

import torch

if TYPE_CHECKING:
    from types import TracebackType

    from .ledger import Ledger

__all__ = ["ONE_STREAM", "StreamSwitches", "StreamUse"]


@dataclass(frozen=True)
class StreamUse:
    """How a run's storages meet the allocator's per-stream rules, for its replay. ``switches``: ``(seq, stream)``
    in seq order, where the run made ``stream`` current (:class:`StreamSwitches`); a storage made with a larger
    seq, before the next switch, is made on it; none: every storage on the current stream. ``held``:
    ``(key, limit)`` for storages a library uses on another stream than their own (``record_stream``): each time
    one is freed (or resized to nothing), its block waits for that stream's events out of the cache
    (:mod:`memprof.anatomy.alloc_events`), and the oldest waiting block is released when a held storage is made
    while ``limit`` wait (the library's rate limiter: FSDP1 lets ``limit_all_gathers`` keep two frees in flight)."""

    switches: tuple[tuple[int, int], ...] = ()
    held: tuple[tuple[int, int], ...] = ()


#: One stream for every storage, none held: a run that switched no stream.
ONE_STREAM = StreamUse()


class _StreamCall(Protocol):
    """``torch.cpu.stream``: the context that makes ``stream`` current (called by keyword too)."""

    def __call__(self, stream: "torch.cpu.Stream") -> ContextManager[object]: ...


class StreamSwitches:
    """Notes where a simulated run switches streams: :attr:`switches` is a list of ``(seq, stream)``, the
    ledger's event count when ``stream`` became current (storages made with a larger seq are made on it)."""

    def __init__(self, ledger: "Ledger") -> None:
        self.ledger = ledger
        self.switches: list[tuple[int, int]] = []
        self._ids: dict[int, tuple[int, object]] = {}  # id(stream object) -> (its number, the object kept alive)
        self._current = [0]
        self._native: "_StreamCall | None" = None
        self._default: "torch.cpu.Stream | None" = None

    def install(self) -> None:
        """Put the noting context in ``torch.cpu.stream``'s place, until :meth:`uninstall`."""
        self._native = torch.cpu.stream
        self._default = torch.cpu.current_stream()
        torch.cpu.stream = self._stream  # the same call, noting the switch

    def uninstall(self) -> None:
        if self._native is not None and torch.cpu.stream == self._stream:
            torch.cpu.stream = self._native
        self._native = None

    def _number(self, stream: object) -> int:
        if stream is None or stream is self._default:
            return 0
        known = self._ids.get(id(stream))
        if known is None:
            known = self._ids[id(stream)] = (len(self._ids) + 1, stream)
        return known[0]

    def _switch(self, number: int) -> None:
        if number != (self.switches[-1][1] if self.switches else 0):
            self.switches.append((self.ledger.seq, number))

    def _stream(self, stream: "torch.cpu.Stream") -> "_Current":
        return _Current(self, self._number(stream), self._native(stream) if self._native is not None else None)


class _Current:
    """``with torch.cpu.stream(s):`` while switches are noted: torch's own context, entered and left inside."""

    def __init__(self, owner: StreamSwitches, number: int, native: "ContextManager[object] | None") -> None:
        self.owner, self.number, self.native = owner, number, native

    def __enter__(self) -> object:
        entered = self.native.__enter__() if self.native is not None else None
        owner = self.owner
        owner._switch(self.number)
        owner._current.append(self.number)
        return entered

    def __exit__(self, kind: "type[BaseException] | None", exc: "BaseException | None",
                 tb: "TracebackType | None") -> "bool | None":
        owner = self.owner
        if len(owner._current) > 1:
            owner._current.pop()
        owner._switch(owner._current[-1])
        return self.native.__exit__(kind, exc, tb) if self.native is not None else None
