"""The ranks of one distributed run: :func:`merge` and the :class:`Merged` it returns
(:mod:`memprof.analyse.merge`'s record, each rank a Report here; its text, table and HTML are the views
:mod:`.views` registers)."""

from __future__ import annotations

import dataclasses
from typing import Iterable

from ..analyse import merge as merging
from ..analyse.merge import Merged
from ..record.estimate import Estimate
from ..record.trace import TraceSource, as_trace
from .reports import Report
from .wrap import same_as

__all__ = ["Merged", "merge"]


@same_as(merging.merge)
def merge(reports: "Iterable[TraceSource] | Estimate", *, mixed: bool = False) -> Merged:
    data = merging.merge(reports, mixed=mixed)
    return dataclasses.replace(data, ranks={rank: Report(as_trace(trace)) for rank, trace in data.ranks.items()})
