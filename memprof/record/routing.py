"""A real run's routing: which experts each router call of a mixture-of-experts model chose, as counts.

``memprof.profile(..., record_routing=True)`` keeps, for every router call inside the model's forward (a
``topk`` or ``argmax`` over floating scores), the module that made it, how many choices it had, how many it
picked per token and how many tokens each choice got. That is all a simulation needs to replay the run's
routing: every allocation of an expert layer depends on how many tokens each expert gets, never on which
(``memprof.estimate(..., routing=report)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import fields as fileform
from .checks import corrupt, count, seq, text
from .aliases import JSON, JSONObject
from .fields import form

__all__ = ["RouterCall", "RoutingRecord", "MAX_ROUTER_CALLS"]

#: Router calls a record keeps at most (the first ones), so that a long run's record stays bounded.
MAX_ROUTER_CALLS = 20_000


@dataclass(frozen=True)
class RouterCall:
    """One router call: ``module`` (its path in the model, "" for the root) chose ``picks`` of ``choices``
    for each of ``rows`` tokens, and choice ``e`` was chosen ``counts[e]`` times (``sum(counts) == rows *
    picks``)."""

    module: str
    choices: int
    picks: int
    counts: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(self.counts) // self.picks if self.picks else 0

    # Written by hand, not from its fields (record/fields.py): a router call is a positional list in the file
    # (a run keeps up to MAX_ROUTER_CALLS of them), and its counts are checked against its choices and picks.
    def to_list(self) -> list[JSON]:
        return [self.module, self.choices, self.picks, list(self.counts)]

    @classmethod
    def from_list(cls, data: object) -> "RouterCall":
        module, choices, picks, counts = seq(data, "a router call", 4)
        call = cls(text(module, "a router call's module"), count(choices, "a router call's choices"),
                   count(picks, "a router call's picks"),
                   tuple(count(c, "a router call's count") for c in seq(counts, "a router call's counts")))
        if len(call.counts) != call.choices or call.picks < 1 or sum(call.counts) % call.picks:
            raise corrupt(f"a router call of {call.module or 'the model'} has {len(call.counts)} counts for "
                          f"{call.choices} choices, summing to {sum(call.counts)} for {call.picks} picks per token")
        return call


@dataclass(frozen=True)
class RoutingRecord:
    """Every router call of a run, in the order they ran. ``truncated``: the run made more calls than
    :data:`MAX_ROUTER_CALLS`, and only the first are kept."""

    calls: tuple[RouterCall, ...] = field(default=(), metadata=form(
        label="router calls", read=lambda v, n: tuple(RouterCall.from_list(c) for c in seq(v, n)),
        write=lambda calls: [c.to_list() for c in calls]))
    truncated: bool = field(default=False, metadata=form(label="the routing record's truncated"))

    def by_module(self) -> dict[str, list[tuple[int, ...]]]:
        """Each router module's calls, in order: its per-choice token counts."""
        out: dict[str, list[tuple[int, ...]]] = {}
        for c in self.calls:
            out.setdefault(c.module, []).append(c.counts)
        return out

    def imbalance(self) -> float:
        """The largest share of a call's tokens any one choice got, over the share an even split gives
        (1.0: every call perfectly balanced); 0.0 without calls."""
        worst = 0.0
        for c in self.calls:
            total = sum(c.counts)
            if total:
                worst = max(worst, max(c.counts) * c.choices / total)
        return worst

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "RoutingRecord":
        return fileform.read(cls, data, "the routing record")
