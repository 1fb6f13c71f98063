"""Expert parallelism in a simulation: the all-to-all of per-expert token counts, answered from the routing.

A token-choice MoE split over ``EP`` ranks (experts ``E / EP`` per rank) sends each (token, expert) pair to the
rank that holds the expert with an all-to-all and brings the results back with a second one (GShard, Lepikhin
et al. 2020, §2.2 and §3.2; torchtitan's ``expert_parallel.py`` and transformers' ``AllToAllEP``, whose
``all_to_all_single_autograd`` splits are lists of ints). How many rows a rank receives is data: each rank
counts the tokens it routes to every expert (``bincount``, ``scatter_add_``), exchanges the counts with a first
all-to-all (``dist.all_to_all_single`` or the functional ``all_to_all_single``), and reads both sides back with
``tolist()`` as the split sizes of the token exchange.

On shape-only tensors the router's choices come from the routing assumption (:mod:`memprof.simulate.routing`)
and every value that follows is carried as a value shadow (:mod:`memprof.simulate.shadows`), the counts this
rank sends included. What the other ranks send cannot follow from this rank's routing, and on torch's fake
process group the received buffer holds no data, so :class:`CountsExchange` gives the received counts of every
all-to-all whose input has a shadow:

* every rank's recorded routing (``routing=[report_rank0, report_rank1, ...]``): source ``s`` sends what its own
  record says, its ``i``-th router call's counts (summed by rank when the exchange carries one count per rank)
  for the ``i``-th exchange, chunk ``r``: the run replayed exactly;
* ``balanced`` and one rank's replayed routing: every EP rank routes as this one does, so each source sends this
  rank the counts of this rank's experts (``input chunk r`` from every rank);
* ``worst`` and ``capacity=<f>``: this rank is the one the most tokens reach, the one whose receive buffer and
  expert activations grow: every source sends it the heaviest chunk this rank's own counts hold (the chunk of
  one rank's experts with the most tokens). Each rank still sends by its own routing, so the receive side is an
  upper bound for any rank, never a figure below the busiest one's.

The exchange itself runs as the shape-only op: its buffers are counted where every collective's are, as
``communication``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import torch
from torch._ops import OpOverload

from ..errors import is_interrupt

if TYPE_CHECKING:
    from torch._C._distributed_c10d import ProcessGroup
    from torch.distributed.distributed_c10d import GroupName

    from ..record.routing import RoutingRecord
    from .aliases import OpValue

__all__ = ["CountsExchange", "EXCHANGE_OPS"]


def _ops() -> "tuple[frozenset[OpOverload], OpOverload | None, OpOverload | None]":
    try:
        functional = torch.ops._c10d_functional.all_to_all_single.default
        inplace = torch.ops.c10d.alltoall_base_.default
    except (AttributeError, RuntimeError) as failure:  # a torch built without distributed
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return frozenset(), None, None
    return frozenset({functional, inplace}), functional, inplace


#: The all-to-all ops (functional and in place) whose received counts are answered.
EXCHANGE_OPS, _FUNCTIONAL, _INPLACE = _ops()


class _Shadows(Protocol):
    """The value shadows an exchange reads and fills (:class:`memprof.simulate.shadows.ShadowStore`, which imports
    this module)."""

    def get(self, t: torch.Tensor, make_lazy: bool = False) -> "torch.Tensor | None": ...

    def put(self, fake: torch.Tensor, real: torch.Tensor) -> None: ...

    def drop(self, fake: torch.Tensor) -> None: ...


class CountsExchange:
    """Received counts of an all-to-all of routing-derived values (the module's docstring), under ``policy``
    (a :class:`~memprof.simulate.routing.Routing`'s: ``"balanced"``, ``"worst"``, ``"capacity"``, ``"replay"``)."""

    def __init__(self, policy: str, ranks: "Sequence[RoutingRecord]" = ()) -> None:
        self.policy = policy
        #: Every rank's router calls' counts, in call order (``routing=`` a list of records by rank).
        self.ranks = [[c.counts for c in r.calls] for r in ranks]
        #: (EP size, this rank in the EP group, rows received from each source) per exchange answered.
        self.calls: list[tuple[int, int, tuple[int, ...]]] = []
        self.mismatched = 0  # exchanges whose own counts were not this rank's recorded ones: answered alike

    def received(self, values: torch.Tensor, group: ProcessGroup, in_splits: "Sequence[int] | None",
                 out_splits: "Sequence[int] | None") -> "torch.Tensor | None":
        """The counts this rank receives for ``values`` (a real tensor: what it sends), or None where the splits
        do not allow an answer (the exchange then runs without one, and a later ``tolist()`` says so)."""
        size, rank = group.size(), group.rank()
        rows = values.shape[0] if values.dim() else 0
        ins = list(in_splits) if in_splits else ([rows // size] * size if size and rows % size == 0 else None)
        if ins is None or sum(ins) != rows or len(ins) != size:
            return None
        chunks = list(values.split(ins))  # type: ignore[no-untyped-call]  # torch's Tensor.split is untyped
        recorded = self._recorded(values, size, rank, ins) if self.ranks else None
        if recorded is not None:
            self.calls.append((size, rank, tuple(int(c.sum()) for c in recorded)))
            return torch.cat(recorded)
        if self.policy in ("worst", "capacity"):
            # The heaviest chunk: the one whose experts the most tokens reach (the first such chunk, so it is
            # the same chunk on every call of one routing).
            pick = chunks[max(range(size), key=lambda i: (int(chunks[i].sum()), -i))]
        else:
            pick = chunks[rank]
        outs = list(out_splits) if out_splits else [pick.shape[0]] * size
        if len(outs) != size or any(o != pick.shape[0] for o in outs):
            return None
        self.calls.append((size, rank, tuple(int(pick.sum()) for _ in range(size))))
        return torch.cat([pick] * size)

    def _recorded(self, values: torch.Tensor, size: int, rank: int, ins: "list[int]") -> "list[torch.Tensor] | None":
        """What each source's record says it sent this rank at this exchange, or None where the records do not
        say (fewer calls, other ranks, or this rank's own counts not its record's)."""
        i = len(self.calls)
        if len(self.ranks) != size or any(i >= len(calls) for calls in self.ranks) or values.dim() < 1:
            self.mismatched += 1
            return None
        sent = []
        for calls in self.ranks:
            counts = torch.tensor(calls[i], dtype=values.dtype)
            n = values.numel()
            if counts.numel() % n:
                self.mismatched += 1
                return None
            # Per expert, or per rank when one count per rank travels; laid out as this rank's (transformers'
            # AllToAllEP sends an (ep, experts per rank) tensor).
            sent.append(counts.view(n, -1).sum(1).view(values.shape))
        if not torch.equal(sent[rank], values):
            self.mismatched += 1
            return None
        return [v.split(ins)[rank] for v in sent]  # type: ignore[no-untyped-call]  # Tensor.split is untyped

    def answer(self, func: OpOverload, args: tuple[OpValue, ...], kwargs: dict[str, OpValue], store: _Shadows
               ) -> OpValue:
        """Run the exchange ``func(*args, **kwargs)`` as the shape-only op, and give the tensor it fills the
        received counts as its shadow where its input has one. Returns the op's output."""
        if func is _FUNCTIONAL:
            sent, group = _arg(func, args, kwargs, "input"), _group(_arg(func, args, kwargs, "group_name"))
        else:
            sent, group = _arg(func, args, kwargs, "input"), _unboxed(_arg(func, args, kwargs, "process_group"))
        values = store.get(sent) if isinstance(sent, torch.Tensor) else None
        out = func(*args, **kwargs)
        if values is None or group is None:
            return out
        filled = out if func is _FUNCTIONAL else _arg(func, args, kwargs, "output")
        with torch._C._DisableTorchDispatch():
            got = self.received(values, group, _arg(func, args, kwargs, "input_split_sizes"),
                                _arg(func, args, kwargs, "output_split_sizes"))
        if got is None or tuple(got.shape) != tuple(filled.shape):
            store.drop(filled)
            return out
        store.put(filled, got)
        return out

    def notes(self) -> list[str]:
        if not self.calls:
            return []
        size, rank, rows = self.calls[0]
        totals = sorted({sum(c[2]) for c in self.calls})
        how = ("every EP rank routes as this one does, so each sends this rank the counts of this rank's experts"
               if self.policy not in ("worst", "capacity") else
               "this rank is the one the most tokens reach: every source sends it the heaviest share this rank's own "
               "counts hold (each rank still sends by its own routing, so the receive side bounds any rank's)")
        if self.ranks and not self.mismatched:
            how = "every source sent what its recorded run's router chose (every rank's record replayed)"
        elif self.ranks:
            how += (f"; {self.mismatched} exchange(s) did not match the ranks' records (another order of router "
                    "calls and exchanges, or other counts), and were answered so")
        elif self.policy == "replay":
            how += ("; only this rank's routing was replayed, the other ranks' were not recorded, so they are "
                    "assumed to route alike (give every rank's report, routing=[report0, report1, ...], to replay "
                    "theirs)")
        each = (" or ".join(f"{t:,}" for t in totals) if len(totals) <= 3 else
                f"between {totals[0]:,} and {totals[-1]:,}")
        per = {r for c in self.calls for r in c[2]}
        split = f" ({rows[0]:,} from each of {size} EP ranks)" if len(per) == 1 else ""
        return [f"expert parallel: the all-to-all splits came from the routing assumption ({self.policy}): {how}; "
                f"rank {rank} of each EP group of {size} receives {each} token rows per MoE layer{split}, "
                f"{len(self.calls)} exchange(s) of per-expert counts answered; the token all-to-alls' send and "
                "receive buffers are counted as communication, as every collective's are"]


def _arg(func: OpOverload, args: tuple[OpValue, ...], kwargs: dict[str, OpValue], name: str) -> OpValue:
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name, a.default_value)
    return None


def _unboxed(group: "ProcessGroup | torch.ScriptObject") -> "ProcessGroup | None":
    """The ``ProcessGroup`` a c10d op is handed as a script object."""
    try:
        from torch._C._distributed_c10d import ProcessGroup

        return group if isinstance(group, ProcessGroup) else ProcessGroup.unbox(group)
    except (ImportError, RuntimeError, TypeError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return None


def _group(name: GroupName) -> "ProcessGroup | None":
    try:
        from torch._C._distributed_c10d import _resolve_process_group

        return _resolve_process_group(name)
    except (ImportError, RuntimeError, ValueError, TypeError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return None
