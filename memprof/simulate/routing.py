"""Which experts a simulated mixture-of-experts router chooses: the routing assumption of an estimate.

A router picks experts from its scores' values, which shape-only tensors do not have. Wherever the model
asks a router call inside its forward (``topk`` or ``argmax`` over floating scores), the simulation
answers with indices from a :class:`Routing`:

* ``"balanced"`` (the default): token ``t``'s ``j``-th choice is expert ``(t * k + j) mod E``, so every
  expert gets ``T * k / E`` tokens, the remainder one each to the first experts;
* ``"capacity=<factor>"``: experts filled in turn up to ``ceil(factor * T * k / E)`` tokens each, the most
  skewed routing that capacity allows. transformers' routers of these models drop no token, so this shapes
  the counts only; a model that enforces a capacity does so in its own code, which runs as written;
* ``"worst"``: every token's ``k`` choices on the same ``k`` experts;
* a recorded routing: a :class:`~memprof.Report` or :class:`~memprof.Trace` profiled with
  ``record_routing=True``, its :class:`~memprof.record.routing.RoutingRecord`, or counts given by hand:
  a list of per-call per-expert token counts in call order, or a dict of them per router module path;
* every rank's recorded routing, a list of such reports (or records) by rank: the simulated rank replays its
  own, and under expert parallelism the counts each other rank sends it come from theirs
  (:mod:`memprof.simulate.experts`).

Only the counts matter: an expert layer's allocations depend on how many tokens each expert gets, and the
indices built from counts (:func:`indices_from_counts`) give each expert its count, no token an expert
twice.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..errors import InvalidArgumentError, SimulationError, UnknownNameError, is_interrupt
from ..record.routing import RoutingRecord

__all__ = ["Routing", "RoutingPlan", "routing_of", "indices_from_counts", "POLICIES"]

#: The assumptions ``routing=`` names in words (``"capacity=<factor>"`` with a factor).
POLICIES = ("balanced", "worst", "capacity=<factor>")


class Routing:
    """A routing assumption: ``policy`` is ``"balanced"``, ``"worst"``, ``"capacity"`` (with ``factor``) or
    ``"replay"`` (with per-module calls ``by_module``, or ``ordered`` calls in call order)."""

    def __init__(self, policy: str, *, factor: "float | None" = None,
                 by_module: "Mapping[str, Sequence[Sequence[int]]] | None" = None,
                 ordered: "Sequence[Sequence[int]] | None" = None, source: str = "",
                 ranks: "Sequence[RoutingRecord] | None" = None) -> None:
        self.policy, self.factor, self.source = policy, factor, source
        self.by_module = {k: [tuple(c) for c in v] for k, v in (by_module or {}).items()}
        self.ordered = [tuple(c) for c in (ordered or ())]
        #: Every rank's record, by rank (a list of reports given), else empty.
        self.ranks: tuple[RoutingRecord, ...] = tuple(ranks or ())

    def of_rank(self, rank: int) -> "Routing":
        """The routing rank ``rank`` replays: its own record, every rank's kept beside it."""
        if not self.ranks:
            return self
        if not 0 <= rank < len(self.ranks):
            raise InvalidArgumentError(f"routing holds {len(self.ranks)} ranks' records, but rank {rank} is simulated; "
                                       "give one record per rank of the process group, in rank order")
        return Routing("replay", by_module=self.ranks[rank].by_module(), ranks=self.ranks,
                       source=f"rank {rank}'s recorded run ({len(self.ranks[rank].calls)} router calls; every rank's "
                              f"record given, {len(self.ranks)} ranks)")

    def plan(self) -> "RoutingPlan":
        """A fresh cursor over this routing, for one simulation."""
        return RoutingPlan(self)

    def words(self) -> str:
        """The assumption in words, for an estimate's notes."""
        if self.policy == "balanced":
            return "balanced (each router call's top-k spread evenly over the experts)"
        if self.policy == "worst":
            return "worst (every token's top-k on the same k experts)"
        if self.policy == "capacity":
            return (f"capacity={self.factor:g} (experts filled in turn up to {self.factor:g} x an even share; "
                    "no token dropped)")
        return f"replayed from {self.source}"


class RoutingPlan:
    """One simulation's router answers, in order: :meth:`indices` for each router call."""

    def __init__(self, routing: Routing) -> None:
        self.routing = routing
        self.calls = 0
        self.used: dict[str, int] = {}
        self.counts: list[tuple[int, ...]] = []  # what each call got, for the notes

    def indices(self, shape: "tuple[int, ...]", choices: int, dim: int, module: str) -> torch.Tensor:
        """int64 indices of ``shape`` into ``choices``, along ``dim`` (whose size is the picks per token)."""
        moved = list(shape)
        k = moved.pop(dim) if shape else 1
        rows = 1
        for s in moved:
            rows *= s
        counts = self._counts(rows, k, choices, module)
        self.calls += 1
        self.counts.append(counts)
        # Real CPU tensors, whatever modes a simulation has on: no mode may see or count them.
        with torch._C._DisableTorchDispatch():
            flat = indices_from_counts(counts, rows, k)
            if not shape:
                return flat.reshape(())
            return flat.reshape(*moved, k).movedim(-1, dim).contiguous()

    def _counts(self, rows: int, k: int, n: int, module: str) -> tuple[int, ...]:
        r, total = self.routing, rows * k
        if k > n:
            raise SimulationError(f"a router call in {module or 'the model'} picks {k} of {n} choices per token")
        if r.policy == "balanced":
            return tuple(total // n + (1 if e < total % n else 0) for e in range(n))
        if r.policy == "worst":
            return tuple(rows if e < k else 0 for e in range(n))
        if r.policy == "capacity":
            assert r.factor is not None
            # At least an even share (the tokens must fit), at most every token (one pick per token and expert).
            cap = min(rows, max(-(-int(r.factor * total) // n), -(-total // n)))
            out, left = [], total
            for _ in range(n):
                out.append(min(cap, left))
                left -= out[-1]
            return tuple(out)
        return self._recorded(rows, k, n, module)

    def _recorded(self, rows: int, k: int, n: int, module: str) -> tuple[int, ...]:
        r = self.routing
        where = module or "the model"
        if r.by_module:
            calls = r.by_module.get(module)
            if calls is None:
                known = ", ".join(sorted(r.by_module)[:4]) + (" ..." if len(r.by_module) > 4 else "")
                raise SimulationError(
                    f"routing replay: the router {where} has no recorded calls (the record has {known}); record "
                    "the routing from the same model, unwrapped, with memprof.profile(..., record_routing=True)")
            i = self.used.get(module, 0)
            self.used[module] = i + 1
            label = f"call {i} of {where}"
        else:
            calls, i = r.ordered, self.calls
            label = f"router call {i} ({where})"
        if i >= len(calls):
            raise SimulationError(
                f"routing replay: {label} has no recorded counts ({len(calls)} recorded); record a run with at least "
                "as many steps and router calls as the simulation makes")
        counts = calls[i]
        if len(counts) != n or sum(counts) != rows * k or max(counts, default=0) > rows:
            raise SimulationError(
                f"routing replay: {label} picks {k} of {n} for {rows} tokens, but the recorded counts are "
                f"{list(counts)[:8]}{' ...' if len(counts) > 8 else ''} ({len(counts)} choices, {sum(counts)} picks); "
                "record the routing from a run with the same batch shape")
        return counts


def indices_from_counts(counts: "Sequence[int]", rows: int, k: int) -> torch.Tensor:
    """A ``(rows, k)`` int64 index tensor in which choice ``e`` appears ``counts[e]`` times and no row repeats a
    choice: the choices' slots laid out in order and dealt column by column, so one choice's run (at most
    ``rows`` long) never meets the same row twice. Needs ``sum(counts) == rows * k``, each count <= rows."""
    if sum(counts) != rows * k or any(c < 0 or c > rows for c in counts):
        raise InvalidArgumentError(f"counts {list(counts)[:8]} cannot route {rows} tokens to {k} choices each")
    slots = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(list(counts), dtype=torch.long))
    return slots.reshape(k, rows).t().contiguous()


def routing_of(value: object) -> Routing:
    """The :class:`Routing` that ``routing=`` names (see the module's docstring)."""
    if isinstance(value, Routing):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("balanced", "worst"):
            return Routing(word)
        if word.startswith("capacity="):
            try:
                factor = float(word.split("=", 1)[1])
            except ValueError as failure:
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                factor = -1.0
            if not factor > 0 or factor != factor or factor == float("inf"):
                raise InvalidArgumentError(f"routing={value!r}: the capacity factor must be a positive number, as in "
                                           "'capacity=1.25'")
            return Routing("capacity", factor=factor)
        raise UnknownNameError(f"unknown routing {value!r}; use one of: {', '.join(POLICIES)}, a report profiled with "
                               "record_routing=True, or per-call expert counts")
    if isinstance(value, (list, tuple)) and value and all(_record(v) is not None for v in value):
        return Routing("replay", ranks=[_checked(_record(v)) for v in value], source=f"{len(value)} ranks' records")
    record = getattr(getattr(value, "trace", value), "routing", value)
    if record is None:
        raise InvalidArgumentError("this report has no routing record; profile the real run with "
                                   "memprof.profile(..., record_routing=True) to replay its routing")
    if isinstance(record, RoutingRecord):
        if not record.calls:
            raise InvalidArgumentError("the routing record has no router calls: the profiled run's model made no "
                                       "topk or argmax over scores inside its forward")
        return Routing("replay", by_module=record.by_module(), source=f"a recorded run ({len(record.calls)} router "
                       "calls)")
    if isinstance(value, Mapping):
        calls = {str(k): _counts_list(v, f"routing[{k!r}]") for k, v in value.items()}
        return Routing("replay", by_module=calls, source=f"given counts for {len(calls)} router module(s)")
    if isinstance(value, (list, tuple)):
        return Routing("replay", ordered=_counts_list(value, "routing"), source=f"given counts ({len(value)} router "
                       "calls, in call order)")
    raise InvalidArgumentError(f"routing must be one of {', '.join(POLICIES)}, a Report or Trace profiled with "
                               f"record_routing=True, or per-call expert counts; got {type(value).__name__}")


def _counts_list(value: object, name: str) -> list[tuple[int, ...]]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(c, (list, tuple)) for c in value):
        raise InvalidArgumentError(f"{name} must be a list of router calls, each a list of per-expert token counts")
    for c in value:
        if not c or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in c):
            raise InvalidArgumentError(f"{name}: each call's counts must be non-negative ints, got {list(c)[:8]}")
    return [tuple(c) for c in value]


def _record(value: object) -> "RoutingRecord | None":
    """The routing record a report, a trace or a record holds (None for anything else: counts given by hand)."""
    if isinstance(value, RoutingRecord):
        return value
    trace = getattr(value, "trace", value)
    if hasattr(trace, "routing") and hasattr(trace, "phases"):
        record: "RoutingRecord | None" = trace.routing
        if record is None:
            raise InvalidArgumentError("a report given as a rank's routing has no routing record; profile every rank "
                                       "with memprof.profile(..., record_routing=True)")
        return record
    return None


def _checked(record: "RoutingRecord | None") -> RoutingRecord:
    assert record is not None
    if not record.calls:
        raise InvalidArgumentError("a rank's routing record has no router calls: its model made no topk or argmax "
                                   "over scores inside its forward")
    return record
