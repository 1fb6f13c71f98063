"""A plan's rows searched in several processes, with the answers one process gives.

Rows share simulations only within a *group*: one precision and one family of layouts. The batch lines are
measured once per (checkpointing, precision, family), and a row starts from its own row with checkpointing the other
way and from the family's reference (:class:`memprof.simulate.plan._Grid`); nothing crosses precisions or families.
So the groups are independent searches, and each can run in a process of its own (:mod:`memprof.simulate.forked`):
the same simulations, the same answers, in the same order.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable, Sequence

from . import forked as _forked

if TYPE_CHECKING:
    from ..record.plans import PlanRow
    from .layouts import Layout

__all__ = ["searched", "groups_of"]

Config = tuple[bool, str, "Layout"]
Search = Callable[[Sequence[Config]], "list[PlanRow]"]


def groups_of(configs: Sequence[Config]) -> list[list[int]]:
    """The indices of ``configs`` in groups that share no simulation (one precision and family of layouts each),
    each in the grid's order, the groups in the order of their first row."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, (_ckpt, precision, layout) in enumerate(configs):
        groups.setdefault((precision, layout.family or layout.name), []).append(i)
    return list(groups.values())


def searched(configs: Sequence[Config], search: Search, processes: "int | None") -> "tuple[list[PlanRow], int]":
    """The rows ``search`` gives for ``configs``, in their order, and how many processes searched them: in one call
    here, or each group of :func:`groups_of` by a forked process, ``processes`` of them at most
    (:func:`memprof.simulate.forked.processes_for`), the groups dealt out in turn."""
    groups = groups_of(configs)
    n = _forked.processes_for(processes, len(groups))
    if n <= 1:
        return search(configs), 1
    shares = [[i for g in groups[w::n] for i in g] for w in range(n)]
    parts = _forked.forked([partial(search, [configs[i] for i in share]) for share in shares], n, "a plan's rows")
    found = {i: row for share, rows in zip(shares, parts) for i, row in zip(share, rows)}
    return [found[i] for i in range(len(configs))], n
